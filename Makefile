# DSec: `make demo` runs the main job, `make test` runs the whole suite. Both set up what they need.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
SYSTEM_TOOLS := mkfs.erofs busybox bash-static catatonit mkfs.btrfs nsenter ip cc debootstrap lxcfs runsc qemu-system-x86_64 mkfs.ext4 \
                nft openssl apt-cacher-ng apt-ftparchive skopeo docker-registry pkg-config fusermount3

.PHONY: setup system venv demo test bench up clean

setup: system venv

# Debian packages: erofs-utils (mkfs.erofs), busybox-static (the busybox image, and the platform's scripts in a
# sandbox), bash-static (the trusted shell string commands run with: chronus/shell.py), catatonit (sandbox init),
# btrfs-progs (writable layers with a size cap), util-linux, iproute2, gcc + libc6-dev (the static
# dsec-enter helper), debootstrap (`dsec image build --debootstrap`), lxcfs (per-sandbox /proc views; each
# edge runs its own, so Debian's service, which the package starts, is stopped and disabled), runsc (gVisor:
# the gvisor backend kind), qemu-system-x86 and e2fsprogs (the microvm kind; its guest kernel is Debian's
# cloud kernel, fetched into /var/cache/dsec/vm by `python -m edge.backends.microvm`; the fullvm
# kind's Debian with systemd is debootstrapped there by `python -m edge.backends.fullvm`), nftables (Aether's
# rules, through libnftables; Debian's nftables service stays disabled), openssl (the network tests' CA),
# apt-cacher-ng (each node's apt mirror, run by its edge; Debian's service, which the package starts, is
# stopped and disabled), apt-utils (apt-ftparchive: the mirror tests' Debian repository), skopeo (`dsec image
# import --from docker://...`) and docker-registry (the registry the import test starts on loopback; Debian's
# service, which the package starts, is stopped and disabled), and libfuse3-dev, fuse3 and pkg-config (pyfuse3 is
# built against them: lazily loaded layers).
# `apt-get update` runs once first. The services' daemons are stopped by user and name (`pkill -u U -x NAME`), not by
# a pattern of their command line: `pkill -f` matches this recipe's own shell, whose text holds the pattern.
system:
	@missing=""; for t in $(SYSTEM_TOOLS); do command -v $$t >/dev/null 2>&1 || missing="$$missing $$t"; done; \
	ldd "$$(command -v busybox)" >/dev/null 2>&1 && missing="$$missing busybox-static"; \
	pkg-config --exists fuse3 2>/dev/null || missing="$$missing libfuse3-dev"; \
	$(PYTHON) -c "import venv, ensurepip" 2>/dev/null || missing="$$missing python3-venv"; \
	if [ -n "$$missing" ]; then \
	  echo "setup: installing Debian packages (missing:$$missing)"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	    erofs-utils busybox-static bash-static catatonit btrfs-progs util-linux iproute2 gcc libc6-dev \
	    python3-venv procps debootstrap lxcfs runsc qemu-system-x86 e2fsprogs nftables openssl apt-cacher-ng apt-utils \
	    skopeo docker-registry libfuse3-dev fuse3 pkg-config >/dev/null && { \
	  (systemctl disable --now lxcfs.service || update-rc.d lxcfs disable) >/dev/null 2>&1; \
	  pkill -f '^/usr/bin/lxcfs /var/lib/lxcfs' 2>/dev/null; umount -l /var/lib/lxcfs 2>/dev/null; \
	  (systemctl disable --now apt-cacher-ng.service || update-rc.d apt-cacher-ng disable) >/dev/null 2>&1; \
	  pkill -u apt-cacher-ng -x apt-cacher-ng 2>/dev/null; \
	  (systemctl disable --now docker-registry.service || update-rc.d docker-registry disable) >/dev/null 2>&1; \
	  pkill -u docker-registry -x docker-registry 2>/dev/null; true; }; \
	fi

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -m pip install -q --upgrade pip >/dev/null 2>&1 || true
	$(PY) -m pip install -q -e '.[test]'
	@touch $@
	@$(PY) -c "from edge.backends import native; native.ensure_built() or print('setup: no C compiler: execs use the slower fork path')"
	@$(PY) -m edge.backends.microvm || echo "setup: no microvm guest (the microvm backend stays off)"
	@$(PY) -m edge.backends.fullvm || echo "setup: no full-VM OS layer (the fullvm backend stays off)"
	@$(PY) -m edge.e2bbase || echo "setup: no E2B base root (dsec image build base --e2b-base will fetch it)"


demo: setup
	$(VENV)/bin/dsec demo

test: setup
	$(PY) -m pytest -q --durations=25 -m "not long"

test-long: setup
	$(PY) -m pytest -q --durations=25 -m long

bench: setup
	$(PY) -m bench.cycle

up: setup
	$(VENV)/bin/dsec up

clean:
	rm -rf .dsec .pytest_cache
