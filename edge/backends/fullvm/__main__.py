"""`python -m edge.backends.fullvm`: build the full-VM OS layer (see osimage.py); `make setup` runs it."""
import sys

from edge.backends.fullvm.osimage import main

sys.exit(main())
