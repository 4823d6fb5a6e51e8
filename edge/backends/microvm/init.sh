#!/bin/busybox sh
# dsec-init: the microVM guest's /init (in the initramfs, with a static busybox and the kernel modules).
# Devices, found by their virtio-blk serial: dsec-trusted (EROFS: the agent and the trusted shell),
# dsec-disk (ext4: the writable layer), dsec-layer_<i> (EROFS image layers, 0 lowest); with dsec.pmem=<n>
# the lowest n layers are virtio-pmem devices instead (/dev/pmem<i>, in order), mounted with DAX. The root is an
# overlay of the layers under the disk; /.dsec is the trusted device, read-only (the block device itself
# is read-only on the host side, so no remount can make it writable), with the writable layer's upper dir
# bound read-only at /.dsec/upper. The agent runs as pid 1 in the
# root, its stdio the virtio-serial port named dsec.agent.
# With dsec.os=1 (a full VM, q35: the devices are virtio-pci) the agent first starts the root's systemd
# as pid 1 of a pid and mount namespace of its own (dsec-agent.c, start_os), where commands run too.
B=/bin/busybox
fail() { echo "<2>dsec-init: $*" >/dev/kmsg; exec $B sleep 1; }   # <2>: past quiet, to the console
$B mount -t proc proc /proc
$B mount -t sysfs sys /sys
$B mount -t devtmpfs dev /dev
HOST=sandbox
for a in $($B cat /proc/cmdline); do
  case $a in dsec.layers=*) N=${a#*=};; dsec.host=*) HOST=${a#*=};; dsec.pids=*) PIDS=${a#*=};;
    dsec.privileged=1) export DSEC_PRIVILEGED=1;; dsec.os=1) OS=1;; dsec.pmem=*) PMEM=${a#*=};; esac
done
bus=virtio_mmio
[ -n "$OS" ] && bus="virtio_pci_legacy_dev virtio_pci_modern_dev virtio_pci"
for m in virtio_ring virtio $bus virtio_blk virtio_console libcrc32c erofs overlay virtio-rng failover net_failover \
    virtio_net; do
  $B insmod /lib/modules/$m.ko 2>/dev/null || [ -d /sys/module/${m//-/_} ] || fail "insmod $m failed"
done
if [ "${PMEM:-0}" -gt 0 ]; then
  for m in libnvdimm nd_btt nd_pmem nd_virtio virtio_pmem; do
    $B insmod /lib/modules/$m.ko 2>/dev/null || [ -d /sys/module/$m ] || fail "insmod $m failed"
  done
fi
$B hostname "$HOST"
$B ip link set lo up || fail "loopback"    # (a full VM's systemd would; a microVM's servers need it too)
for b in /sys/block/vd*; do
  s=$($B cat $b/serial 2>/dev/null)
  case $s in dsec-*) eval "dev_${s#dsec-}=/dev/${b##*/}";; esac
done
dev() { eval "echo \$dev_$1"; }
$B mkdir -p /trusted /rw /newroot
$B mount -t erofs -o ro "$(dev trusted)" /trusted || fail "no trusted device"
$B mount -t ext4 -o nosuid,nodev "$(dev disk)" /rw || fail "no writable disk"
$B mkdir -p /rw/upper /rw/work
lower=""
i=0
while [ "$i" -lt "${N:-0}" ]; do
  $B mkdir -p /layers/$i
  if [ "$i" -lt "${PMEM:-0}" ]; then    # the nvdimm bus probes its regions after insmod returns
    w=0; while [ ! -b /dev/pmem$i ] && [ $w -lt 500 ]; do $B usleep 10000; w=$((w + 1)); done
    # read-only to the guest's kernel too: QEMU drops a write to the mapping (its file is read-only), but a
    # buffered write's flush would wait on it for ever; refused, a stray write is an error at once
    $B blockdev --setro /dev/pmem$i || fail "pmem$i read-only"
    $B mount -t erofs -o ro,dax=always /dev/pmem$i /layers/$i || fail "layer $i did not mount from pmem$i"
  else
    $B mount -t erofs -o ro "$(dev layer_$i)" /layers/$i || fail "layer $i did not mount"
  fi
  lower="/layers/$i${lower:+:$lower}"
  i=$((i + 1))
done
[ -n "$lower" ] || { $B mkdir -p /layers/empty; lower=/layers/empty; }
$B mount -t overlay -o "lowerdir=$lower,upperdir=/rw/upper,workdir=/rw/work" overlay /newroot || fail "overlay"
cd /newroot
$B mkdir -p proc sys dev tmp .dsec
$B chmod 1777 tmp
[ -n "$OS" ] || $B mount -t sysfs -o ro sys sys
$B mount -t devtmpfs dev dev
# POSIX shared memory (shm_open, semaphores, Python's multiprocessing locks): a full VM's systemd mounts its own
[ -n "$OS" ] || { $B mkdir -p dev/shm && $B mount -t tmpfs -o nosuid,nodev,mode=1777 shm dev/shm; }
$B mount --bind /trusted .dsec
$B mount -o remount,bind,ro,nosuid,nodev .dsec
# The raw writable layer, read-only, for the agent to pack a snapshot from (its owner's own files).
$B mount --bind /rw/upper .dsec/upper
$B mount -o remount,bind,ro,nosuid,nodev,noexec .dsec/upper
port=""
for p in /sys/class/virtio-ports/*; do [ "$($B cat $p/name 2>/dev/null)" = dsec.agent ] && port=${p##*/}; done
[ -n "$port" ] || fail "no agent port"
# Commands may hold the guest's memory less what the kernel, the agent and the page cache of what runs
# need (32 MiB): past it the command is OOM-killed at once (the agent's memory group), never thrashing.
total=$($B awk '/^MemTotal:/ { print $2 * 1024 }' /proc/meminfo)
export DSEC_MEMORY_MAX=$((total - (32 << 20)))
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin DSEC_PIDS_MAX=${PIDS:-256} DSEC_VM=1
if [ -n "$OS" ]; then    # the agent starts the root's systemd (its own namespaces) before anything else
  [ -x /newroot/lib/systemd/systemd ] || fail "the image has no /lib/systemd/systemd: it cannot boot as a full VM"
  export DSEC_OS=1
fi
# The agent is pid 1 of a pid namespace of its own (this shell stays the kernel's init and waits for it):
# commands see their own processes in /proc, not the guest kernel's threads. In its mount namespace the
# initramfs's own mounts are gone before it starts: /newroot is entered by chroot (the initramfs cannot
# be pivoted away), and a root command that climbs out of a chroot of its own reaches only the
# initramfs's files, never the kernel's unmasked /proc, a writable /sys or the raw devices.
exec $B unshare -p -f -m $B sh -c "$B mount -t proc proc /newroot/proc && $B umount -l /proc /sys /dev /rw /trusted \
  && for l in /layers/*; do $B umount -l \$l 2>/dev/null; done; exec $B chroot /newroot /.dsec/agent" \
  0<>/dev/$port 1>&0 2>/dev/kmsg
