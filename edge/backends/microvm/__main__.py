"""`python -m edge.backends.microvm`: fetch the guest kernel and build the microVM guest (see guest.py);
`make setup` runs it."""
import sys

from edge.backends.microvm.guest import main

sys.exit(main())
