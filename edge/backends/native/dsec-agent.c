/* dsec-agent: the process a gVisor sandbox starts with (its pid 1), which runs the sandbox's execs.
 *
 * It talks to the edge over its stdin (requests) and stdout (replies), two host pipes the sentry
 * hands the container as its stdio; its stderr is a log file. Every frame is
 *     u32 length (of what follows), u8 type, u32 exec id, payload        (little-endian)
 * Requests:  'E' exec: u32 argc, u32 envc, then cwd, argv..., env... each NUL-terminated; with argc's top
 *                bit set, a user "UID:GID[:GROUP...]" follows cwd: the command runs as it (setgroups,
 *                setresgid, setresuid after its setup; its capabilities go with root's uid); with the next
 *                bit, "ROWS COLS" follows (after the user): the command runs on a terminal of that size, its
 *                controlling one (stdin, stdout and stderr; its output comes as stdout, EIO is its end)
 *            'Y' u16 rows, u16 cols: resize the exec's terminal
 *            'I' stdin bytes for the exec (empty payload: close its stdin)
 *            'S' u32 signal to the exec's process group      'K' kill the exec's whole tree
 *            'G' u32 output bytes the edge has consumed (flow-control credit)
 *            'H' set the hostname to the payload (answered 'H' u32 errno, with the same id)
 *            'W' woken from a template (a restored VM): i64 seconds, i64 nanoseconds of the host's clock,
 *                32 bytes of the host's randomness, the hostname; the agent sets the clock, mixes the
 *                bytes into the kernel's pool and reseeds its RNG (siblings of one template share no
 *                RNG state), sets the hostname (answered 'H' u32 errno of the first step that failed)
 *            'Z' u8 1: freeze a VM's writable layer (FIFREEZE of the filesystem under /.dsec/upper: writers
 *                wait, readers go on) and list its opaque dirs; u8 0: thaw it. Answered 'H' u32 errno,
 *                then, for a freeze, the opaque dirs' paths relative to the layer, each NUL-terminated
 *            'Q' go quiet before a VM's memory is saved (answered 'H' u32 0, then no frame until 'U'): every
 *                frame it wrote is out, it reads nothing of its execs, and the edge sends nothing more, so
 *                the saved channel holds no half frame either way
 *            'U' u8 detach: speak again (answered 'H' u32 0, u32 the highest exec id in use). With detach 1 (a VM started from a memory
 *                snapshot, whose edge never started its execs) every running exec is let go: its processes
 *                run on, their output is read and dropped, no frame names them again and their ids are free
 *            (an 'E' request's argc: bit 31 a user follows its cwd, bit 30 a terminal's size, bit 29 it ends
 *            with its command: end_with_command)
 * Replies:   'R' ready (id 0, once)    'P' u32 pid: started    'F' stage\0errno\0text: never started
 *            'O' / 'e' stdout / stderr bytes    'A' one 'I' frame written    'C' its stdin is gone
 *            'X' i32 wait status, u64 cpu microseconds, u64 peak rss KiB: exited, pipes at EOF
 * Each exec is a session leader (setsid) of its own, in a pids group of its own (/dev/.pids/sandbox/x<id>,
 * below the sandbox's limit): its tree is that group's members (a double fork or setsid does not leave
 * it), plus its session, process group and their descendants; it runs without CAP_SYS_ADMIN (nothing can be mounted over /.dsec, nor the
 * hostname changed), which the agent keeps, nor CAP_SYS_MODULE, CAP_SYS_RAWIO, CAP_SYS_PTRACE, CAP_SYS_BOOT and CAP_SYS_RESOURCE.
 * A microVM's guest runs it as pid 1 too, its stdio one virtio-serial port (microvm/init.sh). An exec stops being read once WINDOW bytes of its output are not yet consumed.
 * In gVisor the commands run in a pid namespace of their own under a /proc of their own, where the agent has
 * no pid; a spawner they cannot see forks them (dsec-commands.h); the pids hierarchy is covered for them (the
 * agent keeps it open).
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <grp.h>
#include <ftw.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <linux/fs.h>
#include <linux/random.h>
#include <sys/ioctl.h>
#include <sched.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <linux/capability.h>
#include <sys/wait.h>
#include <sys/xattr.h>
#include <time.h>
#include <unistd.h>

#include "dsec-become.h"

#define MAXEXEC 256
#define WINDOW (1 << 20)
#define CHUNK (64 << 10)

struct exec {
    uint32_t id;
    pid_t pid;                  /* 0: free slot */
    int out[2];                 /* stdout, stderr read ends; -1 at EOF */
    int in;                     /* stdin write end; -1 closed */
    char *pend; size_t plen, poff;   /* one 'I' frame being written */
    int status_known, status;
    struct rusage ru;
    long inflight;              /* output bytes sent, not yet credited */
    int detached;               /* started by the edge of the VM a memory snapshot was taken of: no frames */
    int tty;                    /* the master of its terminal (resizes), -1: none */
    int end_on_exit;            /* it ends with its command (end_with_command) */
};

static struct exec execs[MAXEXEC];
static const int dropped[] = {21, 16, 17, 19, 22, 24};
static int mem_ok;             /* the memory group of a VM's commands is set up */
static int groups_ok;           /* the pids cgroup is mounted: execs get groups of their own */
static int pidsfd = -1;         /* that hierarchy (/dev/.pids), held: gVisor's commands find it covered */
static uint32_t stale[MAXEXEC]; /* groups of finished execs whose background processes still live */
static int nstale;
static void group_path(char *buf, size_t n, uint32_t id, const char *file);
static void sweep_groups(void);
static int kill_group(uint32_t id);
static void write_file(const char *path, const char *text);
static void write_at(int dirfd, const char *path, const char *text);
static int sigpipe[2];
static int quiet;               /* between 'Q' and 'U': no frame goes out, no exec is read */
static char *rbuf; static size_t rlen, rcap;

/* In a VM its stderr is the kernel's log: "<3>" puts a fatal line past `quiet`, onto the console. */
static void die(const char *what) {
    fprintf(stderr, "%sdsec-agent: %s: %s\n", getenv("DSEC_VM") ? "<3>" : "", what, strerror(errno));
    _exit(111);
}

static void put32(char *p, uint32_t v) { memcpy(p, &v, 4); }
static uint32_t get32(const char *p) { uint32_t v; memcpy(&v, p, 4); return v; }

static void writeall(int fd, const char *p, size_t n) {
    while (n) {
        ssize_t w = write(fd, p, n);
        if (w < 0) { if (errno == EINTR) continue; die("write to edge"); }
        p += w; n -= (size_t)w;
    }
}

static void reply(char type, uint32_t id, const void *a, size_t alen, const void *b, size_t blen) {
    char head[9];
    put32(head, (uint32_t)(5 + alen + blen)); head[4] = type; put32(head + 5, id);
    writeall(1, head, 9);
    if (alen) writeall(1, a, alen);
    if (blen) writeall(1, b, blen);
}

static struct exec *find(uint32_t id) {
    for (int i = 0; i < MAXEXEC; i++) if (execs[i].pid && !execs[i].detached && execs[i].id == id) return &execs[i];
    return NULL;
}

static void on_sigchld(int sig) { (void)sig; int e = errno; (void)!write(sigpipe[1], "c", 1); errno = e; }

static void fail_child(int fd, const char *stage) {
    char msg[512];
    int e = errno;
    int n = snprintf(msg, sizeof msg, "%s%c%d%c%s", stage, 0, e, 0, strerror(e));
    (void)!write(fd, msg, (size_t)n);
    _exit(127);
}

/* What a command must not reach, as in a container: the groups that hold its limits (a root command could
 * move itself out of them), /proc files that act on or tell of the kernel, and /proc/sys to write. */
static const char *const masked_proc[] = {"kcore", "keys", "key-users", "latency_stats", "timer_list", "sched_debug",
    "sysrq-trigger", "kpageflags", "kpagecount", "kpagecgroup", "slabinfo", "vmallocinfo", "partitions"};
static int privileged;          /* DSEC_PRIVILEGED (a VM created with privileged=True): none of that */
static int in_os;               /* DSEC_OS: a full VM, whose root's systemd the agent starts (start_os) */
static pid_t os_pid;            /* that systemd (the agent's pid for it) */
static int os_mnt = -1;         /* its mount namespace, which commands enter */
static int in_vm;               /* DSEC_VM: a guest kernel of its own. gVisor's sentry (2022) shares a child's
                                 * new mount namespace with its parent, so masks there would be the agent's */
static int procfd = -1;         /* the agent's /proc (its own pid namespace's): what it reads of processes */
static pid_t commands_init;     /* gVisor: pid 1 of the commands' pid namespace (dsec-commands.h), else 0 */

/* In an exec's child, before its capabilities go: a mount namespace of its own with those masks (it
 * keeps the agent's root; without CAP_SYS_ADMIN nothing of it can be undone). */
static void confine(int errfd) {
    char path[64];
    if (unshare(CLONE_NEWNS)) fail_child(errfd, "unshare");
    if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL)) fail_child(errfd, "private");
    /* A full VM's systemd mounts the same cgroup hierarchies under /sys/fs/cgroup: hidden too (a microVM
     * mounts none there: one mount less per exec, which TCG makes dear). */
    const char *groups[] = {"/dev/.pids", "/dev/.mem", "/sys/fs/cgroup"};
    for (int i = 0; i < (in_os ? 3 : 2); i++)
        if (access(groups[i], F_OK) == 0 &&
            mount("none", groups[i], "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=4k,mode=000"))
            fail_child(errfd, "hide groups");
    for (size_t i = 0; i < sizeof masked_proc / sizeof *masked_proc; i++) {
        snprintf(path, sizeof path, "/proc/%s", masked_proc[i]);
        if (access(path, F_OK) == 0 && mount("/dev/null", path, NULL, MS_BIND, NULL)) fail_child(errfd, "mask /proc");
    }
    if (mount("/proc/sys", "/proc/sys", NULL, MS_BIND | MS_REC, NULL)) fail_child(errfd, "bind /proc/sys");
    if (mount(NULL, "/proc/sys", NULL, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL))
        fail_child(errfd, "/proc/sys read-only");
}

/* A microVM's commands share one mount namespace with confine()'s masks, made once at start: a
 * namespace copied and masked per exec, then torn down at its exit, cost each exec ~1 ms under TCG.
 * Nothing in it can change after: no command keeps CAP_SYS_ADMIN over it, and its mounts are private.
 * A full VM's commands keep one each (a copy of systemd's namespace as it is at that exec). */
static int confined_mnt = -1;

static void make_confined(void) {
    int rep[2];
    char msg[512];
    if (pipe2(rep, O_CLOEXEC)) die("pipe");
    pid_t pid = fork();
    if (pid < 0) die("fork");
    if (pid == 0) {
        close(rep[0]);
        confine(rep[1]);
        (void)!write(rep[1], "", 1);        /* one NUL byte: done; the parent keeps the namespace */
        pause();
        _exit(0);
    }
    close(rep[1]);
    ssize_t k;
    while ((k = read(rep[0], msg, sizeof msg - 1)) < 0 && errno == EINTR) {}
    close(rep[0]);
    if (k == 1 && !msg[0]) {
        snprintf(msg, sizeof msg, "/proc/%d/ns/mnt", pid);
        confined_mnt = open(msg, O_RDONLY | O_CLOEXEC);
    }
    if (confined_mnt < 0)           /* each exec then masks a namespace of its own, as a full VM's */
        fprintf(stderr, "dsec-agent: the commands' mount namespace: %s\n", k > 0 ? msg : strerror(errno));
    kill(pid, SIGKILL);
    while (waitpid(pid, NULL, 0) < 0 && errno == EINTR) {}
}

/* execvpe over the exec's own PATH (not the agent's). */
static void run(char **argv, char **envp, int errfd) {
    if (strchr(argv[0], '/')) { execve(argv[0], argv, envp); fail_child(errfd, "exec"); }
    const char *path = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
    for (char **e = envp; *e; e++) if (!strncmp(*e, "PATH=", 5)) path = *e + 5;
    int saved = ENOENT;
    char buf[4096];
    for (const char *p = path; ; ) {
        const char *end = strchrnul(p, ':');
        int n = snprintf(buf, sizeof buf, "%.*s/%s", (int)(end - p), p, argv[0]);
        if (n > 0 && (size_t)n < sizeof buf) {
            execve(buf, argv, envp);
            if (errno != ENOENT && errno != ENOTDIR) saved = errno;
        }
        if (!*end) break;
        p = end + 1;
    }
    errno = saved;
    fail_child(errfd, "exec");
}

/* What an exec's child is given: everything it takes before its command's execve. */
struct child {
    const char *group, *user, *cwd;     /* its pids group's join file, UID:GID:GROUPS or NULL, its cwd */
    int groups_ok, mem_ok, master;      /* master: a terminal's, or -1 */
    int in, out, err, rep;              /* its stdio pipes' ends, and the pipe its failure is told on */
    int report_pid;                     /* its first 4 bytes there: its pid in the commands' pid namespace */
    char **argv, **envp;
};

/* An exec's child, before its command: its groups, namespaces, capabilities, stdio, user and cwd. In a VM
 * it runs as a vfork (exec_spawn): on the agent's memory while the agent waits, so it only makes system
 * calls and writes its own stack; its oom_score_adj is its own (the kernel does not pass a vfork child's
 * on to the memory's other users). */
static int exec_child(void *arg) {
    const struct child *c = arg;
    sigset_t none; sigemptyset(&none); sigprocmask(SIG_SETMASK, &none, NULL);
    signal(SIGCHLD, SIG_DFL); signal(SIGPIPE, SIG_DFL);
    if (c->report_pid) { pid_t me = getpid(); (void)!write(c->rep, &me, 4); }
    setsid();
    if (c->groups_ok) {
        int fd = openat(pidsfd, c->group, O_WRONLY | O_CLOEXEC);
        if (fd < 0 || write(fd, "0", 1) != 1) fail_child(c->rep, "setup");
        close(fd);
    }
    if (c->mem_ok) write_file("/dev/.mem/sandbox/tasks", "0");    /* (a guest's: tasks, as c->group) */
    /* A full VM's command: in systemd's mount namespace (its /proc, /run, /sys), in the root there.
     * Its pid namespace is systemd's already (start_os): there the agent has no pid. */
    if (os_mnt >= 0 && (setns(os_mnt, CLONE_NEWNS) || chroot("/newroot"))) fail_child(c->rep, "enter the OS");
    if (confined_mnt >= 0) {        /* its root is the initramfs's again: the guest's is /newroot */
        if (setns(confined_mnt, CLONE_NEWNS) || chroot("/newroot")) fail_child(c->rep, "confine");
    } else if (in_vm && !privileged) confine(c->rep);
    /* SYS_ADMIN, SYS_MODULE, SYS_RAWIO, SYS_PTRACE, SYS_BOOT, SYS_RESOURCE: no mount over /.dsec, no
     * hostname, no kernel module or raw device, no ptrace of the agent (its caps exceed the exec's), and no
     * oom_score_adj below the agent's share (a command at -1000 left the OOM killer nothing but a panic of
     * the guest: helper-44), as a container's commands have none of them either. */
    for (size_t i = 0; !privileged && i < sizeof dropped / sizeof *dropped; i++)
        prctl(PR_CAPBSET_DROP, dropped[i], 0, 0, 0);
    int oom = open("/proc/self/oom_score_adj", O_WRONLY | O_CLOEXEC);   /* the agent's -1000 is not */
    if (oom >= 0) { if (write(oom, "0", 1) < 0) {} close(oom); }       /* the command's */
    if (c->master >= 0) {   /* the terminal's peer, by the master (no path: a full VM's root has its own /dev) */
        int peer = ioctl(c->master, TIOCGPTPEER, O_RDWR | O_NOCTTY);
        if (peer < 0) peer = open(ptsname(c->master), O_RDWR | O_NOCTTY);
        if (peer < 0 || ioctl(peer, TIOCSCTTY, 0)) fail_child(c->rep, "terminal");
        if (c->user && fchown(peer, (uid_t)strtoul(c->user, NULL, 10), (gid_t)-1)) fail_child(c->rep, "terminal");
        if (dup2(peer, 0) < 0 || dup2(peer, 1) < 0 || dup2(peer, 2) < 0) fail_child(c->rep, "setup");
        if (peer > 2) close(peer);
    } else if (dup2(c->in, 0) < 0 || dup2(c->out, 1) < 0 || dup2(c->err, 2) < 0) fail_child(c->rep, "setup");
    if (c->user && become(c->user)) fail_child(c->rep, "user");
    if (chdir(c->cwd)) fail_child(c->rep, "cwd");
    run(c->argv, c->envp, c->rep);
    return 127;
}

/* The child: a vfork in a VM (clone CLONE_VM|CLONE_VFORK on a stack of its own, the agent resumed once
 * its command exec'd or it failed: copying the agent's page tables for a fork cost ~0.5 ms of each exec
 * under TCG); a fork elsewhere (gVisor's sentry). One child at a time is between clone and exec. */
static pid_t exec_spawn(struct child *c) {
    static char stack[64 << 10] __attribute__((aligned(16)));
    if (in_vm) return clone(exec_child, stack + sizeof stack, CLONE_VM | CLONE_VFORK | SIGCHLD, c);
    pid_t pid = fork();
    if (pid == 0) _exit(exec_child(c));
    return pid;
}

/* An 'E' request's payload (see the top): its cwd, user and command into `c` (c->argv, allocated with the
 * environment after it, is the caller's to free), a terminal's size or NULL, the end flag. 0, or -1 if
 * it is cut short. */
static int parse_exec(const char *p, size_t n, struct child *c, const char **size, int *with_end) {
    if (n < 8) return -1;
    uint32_t argc = get32(p), envc = get32(p + 4);
    int with_user = (argc & 0x80000000u) != 0, with_tty = (argc & 0x40000000u) != 0;
    *with_end = (argc & 0x20000000u) != 0;
    *size = NULL;
    argc &= 0x1fffffffu;
    const char *s = p + 8, *end = p + n;
    if (s >= end || argc == 0 || (uint64_t)argc + envc > n) return -1;
    char **vec = calloc(argc + envc + 3, sizeof(char *));
    if (!vec) return -1;
    c->cwd = s;
    s += strnlen(s, (size_t)(end - s)) + 1;
    c->user = NULL;
    if (with_user && s < end) { c->user = s; s += strnlen(s, (size_t)(end - s)) + 1; }
    if (with_tty && s < end) { *size = s; s += strnlen(s, (size_t)(end - s)) + 1; }
    for (uint32_t i = 0; i < argc + envc && s < end; i++) { vec[i + (i >= argc)] = (char *)s; s += strnlen(s, (size_t)(end - s)) + 1; }
    c->argv = vec; c->envp = vec + argc + 1;
    return 0;
}

static void on_wake(int sig) { (void)sig; }

#include "dsec-commands.h"

/* An exec that never had a process: why ('F'), then its end ('X', exit 127 as a command that could not
 * start), as no child will exit to send it (without it the edge waited for the exec's timeout). */
static void never_started(uint32_t id, const char *why, size_t n, const char *text, size_t tn) {
    char p[20] = {0};
    int32_t st = 127 << 8;
    reply('F', id, why, n, text, tn);
    memcpy(p, &st, 4);
    reply('X', id, p, 20, NULL, 0);
}

static void start_exec(uint32_t id, const char *p, size_t n) {
    struct exec *x = NULL;
    for (int i = 0; i < MAXEXEC; i++) if (!execs[i].pid) { x = &execs[i]; break; }
    if (!x) {
        char m[48]; int k = snprintf(m, sizeof m, "setup%c11%c", 0, 0);
        char t[64]; int tn = snprintf(t, sizeof t, "too many execs in this sandbox at once (%d)", MAXEXEC);
        never_started(id, m, (size_t)k, t, (size_t)tn);
        return;
    }
    struct child c = {.master = -1, .report_pid = commands_init || os_pid};
    const char *size;
    int with_end;
    if (parse_exec(p, n, &c, &size, &with_end)) {
        char m[48]; int k = snprintf(m, sizeof m, "setup%c%d%c", 0, EPROTO, 0);
        never_started(id, m, (size_t)k, "a malformed exec request", 24);
        return;
    }
    int master = -1;
    if (size) {             /* a terminal of the sandbox's own devpts (the agent mounted it in a VM) */
        struct winsize ws = { 0 };
        unsigned rows = 24, cols = 80;
        sscanf(size, "%u %u", &rows, &cols);
        ws.ws_row = (unsigned short)rows; ws.ws_col = (unsigned short)cols;
        master = posix_openpt(O_RDWR | O_NOCTTY | O_CLOEXEC);
        if (master < 0 || unlockpt(master) || ioctl(master, TIOCSWINSZ, &ws)) {
            int e = errno; char m[64]; int k = snprintf(m, sizeof m, "terminal%c%d%c", 0, e, 0);
            never_started(id, m, (size_t)k, strerror(e), strlen(strerror(e)));
            if (master >= 0) close(master);
            free(c.argv); return;
        }
    }
    char group[96];
    group_path(group, sizeof group, id, NULL);
    if (groups_ok && mkdirat(pidsfd, group, 0700) && errno != EEXIST)
        fprintf(stderr, "dsec-agent: %s: %s\n", group, strerror(errno));
    if (groups_ok) {        /* the sentry charges a fork to its task's own group only: each one gets the limit */
        group_path(group, sizeof group, id, "pids.max");
        write_at(pidsfd, group, getenv("DSEC_PIDS_MAX"));
    }
    /* A guest kernel's child joins through `tasks` (v1: moves only this thread, which is the whole
     * single-threaded child): writing cgroup.procs takes the global threadgroup rwsem, whose RCU grace
     * period cost each exec 5-10 ms under TCG while the guest idled. gVisor's sentry keeps cgroup.procs. */
    group_path(group, sizeof group, id, in_vm ? "tasks" : "cgroup.procs");
    int in[2], out[2], err[2], rep[2];
    if (pipe2(in, O_CLOEXEC) || pipe2(out, O_CLOEXEC) || pipe2(err, O_CLOEXEC) || pipe2(rep, O_CLOEXEC)) die("pipe");
    c.group = group; c.groups_ok = groups_ok; c.mem_ok = mem_ok; c.master = master;
    c.in = in[0]; c.out = out[1]; c.err = err[1]; c.rep = rep[1];
    pid_t pid = spawn_sock >= 0 ? spawn_command(p, n, &c, group) : exec_spawn(&c);
    if (pid < 0) {
        int e = errno; char m[64]; int k = snprintf(m, sizeof m, "fork%c%d%c", 0, e, 0);
        never_started(id, m, (size_t)k, strerror(e), strlen(strerror(e)));
        close(in[0]); close(in[1]); close(out[0]); close(out[1]); close(err[0]); close(err[1]);
        close(rep[0]); close(rep[1]); free(c.argv);
        if (master >= 0) close(master);
        return;
    }
    close(in[0]); close(out[1]); close(err[1]); close(rep[1]);
    char msg[512]; ssize_t k;
    uint32_t shown = (uint32_t)pid;     /* its pid in the sandbox: in gVisor's and a full VM's commands' pid */
    for (size_t got = 0; (commands_init || os_pid) && got < 4; ) {   /* namespace, its first word */
        uint32_t v;
        ssize_t r = read(rep[0], (char *)&v + got, 4 - got);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) break;
        got += (size_t)r;
        if (got == 4) shown = v;
    }
    while ((k = read(rep[0], msg, sizeof msg)) < 0 && errno == EINTR) {}
    close(rep[0]); free(c.argv);
    memset(x, 0, sizeof *x);
    x->id = id; x->pid = pid; x->out[0] = out[0]; x->out[1] = err[0]; x->in = in[1]; x->tty = -1;
    x->end_on_exit = with_end;
    if (master >= 0) {      /* its output and input are the terminal's: the pipes go */
        close(out[0]); close(err[0]); close(in[1]);
        x->out[0] = master; x->out[1] = -1;
        x->in = fcntl(master, F_DUPFD_CLOEXEC, 0); x->tty = fcntl(master, F_DUPFD_CLOEXEC, 0);
        fcntl(master, F_SETFL, O_NONBLOCK);
    }
    fcntl(x->in, F_SETFL, O_NONBLOCK);
    if (k > 0) reply('F', id, msg, (size_t)k, NULL, 0);
    else reply('P', id, &shown, 4, NULL, 0);
}

static int proc_stat(pid_t pid, pid_t *ppid, pid_t *pgrp, pid_t *sid) {
    char path[64], buf[512];
    snprintf(path, sizeof path, "%d/stat", pid);
    int fd = openat(procfd, path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return -1;
    buf[n] = 0;
    char *r = strrchr(buf, ')');
    char state;
    if (!r || sscanf(r + 2, "%c %d %d %d", &state, ppid, pgrp, sid) != 4) return -1;
    return state == 'Z' ? 1 : 0;
}

/* SIGKILL the exec's session, group and descendants, pass after pass until none is left alive. */
static void kill_tree(struct exec *x) {
    kill(-x->pid, SIGKILL);
    if (groups_ok) kill_group(x->id);
    for (int pass = 0; pass < 200; pass++) {
        pid_t pids[4096], parents[4096]; int live[4096]; int n = 0, found = 0;
        int dfd = openat(procfd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);   /* a fresh read of the agent's */
        DIR *d = dfd < 0 ? NULL : fdopendir(dfd);
        if (!d) { if (dfd >= 0) close(dfd); return; }
        struct dirent *de;
        while ((de = readdir(d)) && n < 4096) {
            pid_t pid = atoi(de->d_name), pp, pg, sd;
            if (pid <= 1 || pid == commands_init) continue;
            int z = proc_stat(pid, &pp, &pg, &sd);
            if (z < 0) continue;
            pids[n] = pid; parents[n] = pp; live[n] = !z && (pg == x->pid || sd == x->pid || pid == x->pid); n++;
        }
        closedir(d);
        for (int changed = 1; changed; ) {      /* descendants of a member are members */
            changed = 0;
            for (int i = 0; i < n; i++) for (int j = 0; j < n && !live[i]; j++)
                if (live[j] && parents[i] == pids[j]) { live[i] = 1; changed = 1; }
        }
        for (int i = 0; i < n; i++) if (live[i]) {
            int z; pid_t pp, pg, sd;
            if ((z = proc_stat(pids[i], &pp, &pg, &sd)) == 0) { kill(pids[i], SIGKILL); found = 1; }
        }
        if (!found) return;
        usleep(1000);
    }
}

static void finish_if_done(struct exec *x) {
    if (!x->pid || !x->status_known || x->out[0] >= 0 || x->out[1] >= 0) return;
    char p[20];
    uint64_t cpu = (uint64_t)(x->ru.ru_utime.tv_sec + x->ru.ru_stime.tv_sec) * 1000000u
                   + (uint64_t)(x->ru.ru_utime.tv_usec + x->ru.ru_stime.tv_usec);
    uint64_t rss = (uint64_t)x->ru.ru_maxrss;
    int32_t st = x->status;
    memcpy(p, &st, 4); memcpy(p + 4, &cpu, 8); memcpy(p + 12, &rss, 8);
    if (!x->detached) reply('X', x->id, p, 20, NULL, 0);
    if (groups_ok && nstale < MAXEXEC) { stale[nstale++] = x->id; sweep_groups(); }
    if (x->in >= 0) close(x->in);
    if (x->tty >= 0) close(x->tty);
    free(x->pend);
    memset(x, 0, sizeof *x);
}

/* gVisor's terminal, once its command exited: what is in it is read, then it counts as ended (the sentry's
 * master never reports the end; a background job still writing to it is cut off). A VM's kernel says EIO
 * when the last holder of the terminal closed it, after every byte (its buffer is pushed asynchronously). */
static void end_terminal(struct exec *x) {
    char buf[CHUNK];
    while (x->out[0] >= 0) {
        ssize_t n = read(x->out[0], buf, sizeof buf);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) { close(x->out[0]); x->out[0] = -1; break; }
        if (x->detached) continue;
        x->inflight += n;
        reply('O', x->id, buf, (size_t)n, NULL, 0);
    }
}

/* An exec that ends with its command (the request's end flag, E2B's commands.run): what its pipes hold
 * when it exited is sent; a process it left running is not waited for, and its pipes close (its next write
 * there fails with EPIPE, as under E2B's envd). */
static void end_with_command(struct exec *x) {
    char buf[CHUNK];
    for (int s = 0; s < 2; s++) {
        if (x->out[s] < 0) continue;
        int left = 0;               /* what it holds now, no more: a process still writing (`yes &`) would */
        if (ioctl(x->out[s], FIONREAD, &left) < 0) left = 0;   /* keep it full, and the agent here, for ever */
        fcntl(x->out[s], F_SETFL, O_NONBLOCK);
        while (left > 0) {
            ssize_t n = read(x->out[s], buf, (size_t)left < sizeof buf ? (size_t)left : sizeof buf);
            if (n < 0 && errno == EINTR) continue;
            if (n <= 0) break;
            left -= (int)n;
            if (x->detached) continue;
            x->inflight += n;
            reply(s ? 'e' : 'O', x->id, buf, (size_t)n, NULL, 0);
        }
        close(x->out[s]);
        x->out[s] = -1;
    }
}

/* A command's end (its wait status and resource use): the agent's child's, or the spawner's. */
static void exited(pid_t pid, int status, const struct rusage *ru) {
    for (int i = 0; i < MAXEXEC; i++) if (execs[i].pid == pid && !execs[i].status_known) {
        execs[i].status_known = 1; execs[i].status = status; execs[i].ru = *ru;
        if (execs[i].end_on_exit) end_with_command(&execs[i]);
        else if (execs[i].tty >= 0 && !in_vm) end_terminal(&execs[i]);
        finish_if_done(&execs[i]);
    }
}

static void reap(void) {
    int status; struct rusage ru; pid_t pid;
    if (nstale) sweep_groups();
    while ((pid = wait4(-1, &status, WNOHANG, &ru)) > 0) {
        if (spawner && pid == spawner) {    /* it ends with the commands' init: no command can run any more */
            fprintf(stderr, "dsec-agent: the commands' pid namespace ended (the spawner: status %d)\n", status);
            exit(0);
        }
        if (os_pid && pid == os_pid) {      /* poweroff, or systemd died: the VM ends with it (init.sh) */
            fprintf(stderr, "<3>dsec-agent: the operating system ended (systemd: status %d)\n", status);
            exit(0);
        }
        exited(pid, status, &ru);
    }
}

/* A full VM: the root's systemd as pid 1 of a pid namespace and a mount namespace of its own, so /proc/1 is
 * systemd for commands and its mounts (/proc, /sys, /run, cgroups) are its own. Every later child of the
 * agent (each command) is in that pid namespace too, where the agent has no pid: no command can signal
 * (kill -9 -1), trace or wait for it; it sees the commands, and systemd, from its own. */
static void start_os(void) {
    int ready[2];
    if (unshare(CLONE_NEWPID)) die("unshare a pid namespace for the OS");
    if (pipe2(ready, O_CLOEXEC)) die("pipe");
    pid_t pid = fork();
    if (pid < 0) die("fork the OS");
    if (pid == 0) {
        sigset_t none; sigemptyset(&none); sigprocmask(SIG_SETMASK, &none, NULL);
        signal(SIGCHLD, SIG_DFL); signal(SIGPIPE, SIG_DFL);
        /* Its /proc replaces the agent's (not over it: a service of systemd's, with every capability, could
         * unmount it and find the agent's pid namespace under it). */
        if (unshare(CLONE_NEWNS) || mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) ||
            umount2("/proc", MNT_DETACH) ||
            mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL)) die("the OS's namespaces");
        int oom = open("/proc/self/oom_score_adj", O_WRONLY | O_CLOEXEC);
        if (oom >= 0) { if (write(oom, "0", 1) < 0) {} close(oom); }
        /* Not privileged: systemd, and so every unit a root command can write and start, has no way to
         * load a module or touch raw devices or ports (its own kernel stays out of the guest's reach). */
        if (!privileged && (prctl(PR_CAPBSET_DROP, 16, 0, 0, 0) ||      /* SYS_MODULE */
                            prctl(PR_CAPBSET_DROP, 17, 0, 0, 0))) die("the OS's bounding set");
        int null = open("/dev/null", O_RDWR);      /* never the agent's channel */
        if (null < 0 || dup2(null, 0) < 0 || dup2(null, 1) < 0) die("the OS's stdio");
        if (null > 2) close(null);
        char *argv[] = {"/lib/systemd/systemd", NULL};
        char *envp[] = {"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", NULL};
        execve(argv[0], argv, envp);
        die("exec /lib/systemd/systemd");
    }
    close(ready[1]);
    char b;
    while (read(ready[0], &b, 1) < 0 && errno == EINTR) {}     /* EOF: it exec'd (its namespaces are made) */
    close(ready[0]);
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/ns/mnt", pid);
    os_mnt = open(path, O_RDONLY | O_CLOEXEC);
    if (os_mnt < 0) die("systemd's mount namespace");
    os_pid = pid;
}

static void stdin_gone(struct exec *x) {
    if (x->in >= 0) close(x->in);
    x->in = -1;
    if (x->pend) { free(x->pend); x->pend = NULL; reply('C', x->id, NULL, 0, NULL, 0); }
}

static void pump_stdin(struct exec *x) {
    while (x->pend && x->poff < x->plen) {
        ssize_t w = write(x->in, x->pend + x->poff, x->plen - x->poff);
        if (w < 0) { if (errno == EAGAIN || errno == EINTR) return; stdin_gone(x); return; }
        x->poff += (size_t)w;
    }
    if (x->pend) { free(x->pend); x->pend = NULL; reply('A', x->id, NULL, 0, NULL, 0); }
}

/* 'U' with detach: the execs of the VM this one was saved from are nobody's here (see the header); their stdin
 * closes. Answers the highest id an exec or a pids group of one still holds: the new edge numbers above it,
 * so no new exec joins an old one's group. */
static uint32_t detach_all(void) {
    uint32_t last = 0;
    for (int i = 0; i < nstale; i++) if (stale[i] > last) last = stale[i];
    for (int i = 0; i < MAXEXEC; i++) {
        struct exec *x = &execs[i];
        if (!x->pid) continue;
        if (x->id > last) last = x->id;
        x->detached = 1;
        x->inflight = 0;
        if (x->in >= 0) close(x->in);
        x->in = -1;
        free(x->pend); x->pend = NULL;
    }
    return last;
}

/* A full VM's /etc/machine-id: 128 random bits in hex, so no two restores of a template share it (what
 * read it while the template booted, journald's files, keeps the template's). 0 or an errno. */
static uint32_t new_machine_id(void) {
    unsigned char raw[16];
    char hex[34];
    if (getrandom(raw, sizeof raw, 0) != (ssize_t)sizeof raw) return (uint32_t)errno;
    raw[6] = (raw[6] & 0x0f) | 0x40; raw[8] = (raw[8] & 0x3f) | 0x80;       /* a v4 UUID, as systemd makes */
    for (int i = 0; i < 16; i++) snprintf(hex + 2 * i, 3, "%02x", raw[i]);
    hex[32] = '\n';
    int fd = open("/etc/machine-id", O_WRONLY | O_TRUNC | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0) return errno == ENOENT || errno == ELOOP ? 0 : (uint32_t)errno;   /* an image's own choice */
    uint32_t e = write(fd, hex, 33) == 33 ? 0 : (uint32_t)(errno ? errno : EIO);
    close(fd);
    return e;
}

/* /etc/hosts names the hostname at 127.0.1.1 (as Debian's installer writes it), so that sudo, `hostname -i`
 * and programs that resolve their own name find it: the image's other lines stay, a 127.0.1.1 line is
 * replaced. Best effort: a symlink (the image's own choice), a file past 16 KiB or a read-only root is left
 * as it is. Written beside and renamed over, so no reader sees half of it. */
static void name_host(const char *name, size_t n) {
    static char old[16384], out[sizeof old + 128];
    static const char plain[] = "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n";
    size_t len = 0, k = 0;
    ssize_t r = 0;
    if (!n || n > 64) return;
    struct stat st;
    int fd = open("/etc/hosts", O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);    /* (a FIFO: no wait) */
    if (fd < 0 && errno != ENOENT) return;
    if (fd < 0) { memcpy(old, plain, sizeof plain - 1); len = sizeof plain - 1; }
    else if (fstat(fd, &st) || !S_ISREG(st.st_mode)) { close(fd); return; }
    else {
        while (len < sizeof old && (r = read(fd, old + len, sizeof old - len)) > 0) len += (size_t)r;
        close(fd);
        if (r < 0 || len == sizeof old) return;
    }
    for (size_t at = 0; at < len; ) {
        const char *nl = memchr(old + at, '\n', len - at);
        size_t end = nl ? (size_t)(nl - old) + 1 : len;
        if (!(end - at > 9 && !memcmp(old + at, "127.0.1.1", 9) && (old[at + 9] == ' ' || old[at + 9] == '\t'))) {
            memcpy(out + k, old + at, end - at);
            k += end - at;
            if (!nl) out[k++] = '\n';
        }
        at = end;
    }
    k += (size_t)snprintf(out + k, sizeof out - k, "127.0.1.1\t%.*s\n", (int)n, name);
    fd = open("/etc/.hosts.dsec", O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0644);
    if (fd < 0) return;
    int ok = write(fd, out, k) == (ssize_t)k && fchmod(fd, 0644) == 0;
    close(fd);
    if (!ok || rename("/etc/.hosts.dsec", "/etc/hosts")) unlink("/etc/.hosts.dsec");
}

/* A restored VM's first request: the host's time, fresh entropy (credited and the CRNG reseeded at once,
 * so no output of the template's RNG state is reused), its own hostname. 0 or an errno. */
static uint32_t wake(const char *p, size_t n) {
    if (n < 48) return EINVAL;
    struct timespec ts;
    int64_t sec, nsec;
    memcpy(&sec, p, 8); memcpy(&nsec, p + 8, 8);
    ts.tv_sec = (time_t)sec; ts.tv_nsec = (long)nsec;
    if (clock_settime(CLOCK_REALTIME, &ts)) return (uint32_t)errno;
    struct { int entropy_count, buf_size; unsigned char buf[32]; } seed = { 256, 32, {0} };
    memcpy(seed.buf, p + 16, 32);
    int r = open("/dev/urandom", O_WRONLY | O_CLOEXEC);
    if (r < 0) return (uint32_t)errno;
    uint32_t e = ioctl(r, RNDADDENTROPY, &seed) || ioctl(r, RNDRESEEDCRNG) ? (uint32_t)errno : 0;
    close(r);
    if (e) return e;
    if (sethostname(p + 48, n - 48)) return (uint32_t)errno;
    name_host(p + 48, n - 48);
    return in_os ? new_machine_id() : 0;
}

/* A microVM's writable layer, bound read-only at UPPER by its init (overlayfs's raw upper dir: whiteouts
 * are 0/0 character devices, an opaque dir carries trusted.overlay.opaque, which only CAP_SYS_ADMIN reads). */
#define UPPER "/.dsec/upper"
static char *opaque; static size_t opaque_len, opaque_cap;

static int note_opaque(const char *path, const struct stat *st, int flag, struct FTW *f) {
    char v[2];
    (void)st; (void)f;
    if (flag != FTW_D || lgetxattr(path, "trusted.overlay.opaque", v, sizeof v) != 1 || v[0] != 'y') return 0;
    const char *rel = path + strlen(UPPER);
    rel += *rel == '/';
    size_t k = strlen(rel) + 1;
    if (opaque_len + k > opaque_cap) { opaque_cap = (opaque_len + k) * 2; opaque = realloc(opaque, opaque_cap); }
    memcpy(opaque + opaque_len, rel, k);
    opaque_len += k;
    return 0;
}

static void freeze_upper(uint32_t id, const char *p, size_t n) {
    uint32_t e = 0;
    int fd = open(UPPER, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    opaque_len = 0;
    if (fd < 0) e = (uint32_t)errno;
    else if (n >= 1 && p[0]) {
        if (ioctl(fd, FIFREEZE, 0) && errno != EBUSY) e = (uint32_t)errno;      /* EBUSY: frozen already */
        else if (nftw(UPPER, note_opaque, 64, FTW_PHYS)) e = (uint32_t)(errno ? errno : EIO);
    } else if (ioctl(fd, FITHAW, 0) && errno != EINVAL) e = (uint32_t)errno;    /* EINVAL: not frozen */
    if (fd >= 0) close(fd);
    reply('H', id, &e, 4, opaque, e ? 0 : opaque_len);
}

static void request(char type, uint32_t id, const char *p, size_t n) {
    if (type == 'E') { start_exec(id, p, n); return; }
    if (type == 'H') {
        uint32_t e = sethostname(p, n) ? (uint32_t)errno : 0;
        if (!e) name_host(p, n);
        reply('H', id, &e, 4, NULL, 0);
        return;
    }
    if (type == 'W') { reply('H', id, (uint32_t[]){ wake(p, n) }, 4, NULL, 0); return; }
    if (type == 'Z') { freeze_upper(id, p, n); return; }
    if (type == 'Q' || type == 'U') {
        uint32_t last[2] = { 0, 0 };
        if (type == 'U' && n >= 1 && p[0]) last[1] = detach_all();
        quiet = type == 'Q';
        reply('H', id, last, type == 'U' ? 8 : 4, NULL, 0);
        return;
    }
    struct exec *x = find(id);
    if (!x) { if (type == 'I') reply('C', id, NULL, 0, NULL, 0); return; }
    if (type == 'I') {
        if (x->in < 0 || x->pend) { reply('C', id, NULL, 0, NULL, 0); return; }
        if (n == 0) { close(x->in); x->in = -1; reply('A', id, NULL, 0, NULL, 0); return; }
        x->pend = malloc(n); memcpy(x->pend, p, n); x->plen = n; x->poff = 0;
        pump_stdin(x);
    } else if (type == 'S' && n >= 4) {
        kill(-x->pid, (int)get32(p));
    } else if (type == 'K') {
        kill_tree(x);
    } else if (type == 'G' && n >= 4) {
        x->inflight -= get32(p);
    } else if (type == 'Y' && n >= 4 && x->tty >= 0) {
        uint16_t rc[2]; memcpy(rc, p, 4);
        struct winsize ws = { .ws_row = rc[0], .ws_col = rc[1] };
        ioctl(x->tty, TIOCSWINSZ, &ws);   /* the kernel sends SIGWINCH to its foreground group */
    }
}

static void read_requests(void) {
    if (rcap - rlen < CHUNK) { rcap = rcap * 2 + CHUNK; rbuf = realloc(rbuf, rcap); }
    ssize_t n = read(0, rbuf + rlen, rcap - rlen);
    if (n == 0) _exit(0);                       /* the edge closed our stdin: the sandbox ends */
    if (n < 0) { if (errno == EINTR || errno == EAGAIN) return; die("read from edge"); }
    rlen += (size_t)n;
    size_t off = 0;
    while (rlen - off >= 4) {
        uint32_t len = get32(rbuf + off);
        if (len < 5) { errno = EPROTO; die("bad frame"); }
        if (rlen - off - 4 < len) break;
        request(rbuf[off + 4], get32(rbuf + off + 5), rbuf + off + 9, len - 5);
        off += 4 + len;
    }
    memmove(rbuf, rbuf + off, rlen - off);
    rlen -= off;
}

static void read_output(struct exec *x, int s) {
    char buf[CHUNK];
    ssize_t n = read(x->out[s], buf, sizeof buf);
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) return;
    if (n <= 0) { close(x->out[s]); x->out[s] = -1; finish_if_done(x); return; }
    if (x->detached) return;
    x->inflight += n;
    reply(s ? 'e' : 'O', x->id, buf, (size_t)n, NULL, 0);
}

static void write_file(const char *path, const char *text) { write_at(AT_FDCWD, path, text); }

static void write_at(int dirfd, const char *path, const char *text) {
    int fd = openat(dirfd, path, O_WRONLY | O_CLOEXEC);
    if (fd < 0 || write(fd, text, strlen(text)) < 0) fprintf(stderr, "dsec-agent: %s: %s\n", path, strerror(errno));
    if (fd >= 0) close(fd);
}

/* Mount a cgroup v1 hierarchy of these controllers at dir and make its group dir/sandbox with file set to value; 1 if done. */
static int sandbox_group(const char *dir, const char *controller, const char *file, const char *value) {
    char path[96];
    mkdir(dir, 0700);
    if (mount("none", dir, "cgroup", MS_NOSUID | MS_NODEV | MS_NOEXEC, controller)) {
        fprintf(stderr, "dsec-agent: mount %s cgroup: %s\n", controller, strerror(errno));
        return 0;
    }
    snprintf(path, sizeof path, "%s/sandbox", dir);
    mkdir(path, 0700);
    snprintf(path, sizeof path, "%s/sandbox/%s", dir, file);
    write_file(path, value);
    return 1;
}

/* The sandbox's pids limit, enforced by the sentry's own pids controller (fork fails with EAGAIN): the
 * agent and so every exec join a group limited to $DSEC_PIDS_MAX, mounted at /dev/.pids (it must stay
 * mounted for the limit to hold). The host cgroup's pids limit is only a backstop for the sentry.
 * In a microVM the cpu controller shares the hierarchy: each exec's group is then a scheduling entity of
 * its own, so a fork bomb's processes share one exec's turn and a command started beside it (and the agent
 * relaying it, in the root group) still runs (one vCPU under TCG: it waited behind all of the bomb's). Not
 * in a full VM, whose systemd mounts cpu (and pids) itself: a hierarchy of both would take them from it. */
static void limit_pids(void) {
    const char *max = getenv("DSEC_PIDS_MAX");
    char pid[32];
    if (!max) return;
    if (!(in_vm && !in_os && sandbox_group("/dev/.pids", "pids,cpu", "pids.max", max)) &&
        !sandbox_group("/dev/.pids", "pids", "pids.max", max)) return;
    pidsfd = open("/dev/.pids", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (pidsfd < 0) { fprintf(stderr, "dsec-agent: /dev/.pids: %s\n", strerror(errno)); return; }
    groups_ok = 1;
    if (in_vm) return;   /* a guest's limit is hierarchical: the agent stays out of it, or a command holding
                          * the limit would refuse its fork of every later exec (a fork bomb's neighbour).
                          * Each exec's child joins its group by moving there, which a full group does not
                          * refuse, as a container's command is attached (one process past the limit). */
    snprintf(pid, sizeof pid, "%d", getpid());
    write_file("/dev/.pids/sandbox/cgroup.procs", pid);
}

/* A VM's memory limit for its commands (DSEC_MEMORY_MAX bytes, set by the microVM's init): a memory group
 * every exec joins, so a command past it is OOM-killed at once instead of thrashing the guest's page
 * cache (the agent stays outside it, and at oom_score_adj -1000). */
static void limit_memory(void) {
    const char *max = getenv("DSEC_MEMORY_MAX");
    if (!max) return;
    mem_ok = sandbox_group("/dev/.mem", "memory", "memory.limit_in_bytes", max);
}

static void group_path(char *buf, size_t n, uint32_t id, const char *file) {
    snprintf(buf, n, "sandbox/x%u%s%s", id, file ? "/" : "", file ? file : "");   /* (under pidsfd) */
}

/* Remove the groups of finished execs that have emptied (rmdir fails while a member lives). */
static void sweep_groups(void) {
    char path[96];
    for (int i = 0; i < nstale; ) {
        group_path(path, sizeof path, stale[i], NULL);
        if (unlinkat(pidsfd, path, AT_REMOVEDIR) == 0 || errno == ENOENT) stale[i] = stale[--nstale]; else i++;
    }
}

/* SIGKILL every member of an exec's group, again and again until it is empty; 1 if it had members. */
static int kill_group(uint32_t id) {
    char path[96], buf[8192];
    int any = 0;
    group_path(path, sizeof path, id, "cgroup.procs");
    for (int pass = 0; pass < 500; pass++) {
        int fd = openat(pidsfd, path, O_RDONLY | O_CLOEXEC);
        if (fd < 0) return any;
        ssize_t n = read(fd, buf, sizeof buf - 1);
        close(fd);
        if (n <= 0) return any;
        buf[n] = 0;
        int found = 0;
        for (char *p = buf, *end; *p; p = end) {
            long pid = strtol(p, &end, 10);
            if (end == p) break;
            if (pid > 1 && kill((pid_t)pid, SIGKILL) == 0) found = 1;
        }
        if (!found) return any;
        any = 1;
        usleep(1000);
    }
    return any;
}

int main(void) {
    if (pipe2(sigpipe, O_CLOEXEC | O_NONBLOCK)) die("pipe");
    struct sigaction sa = {0};
    sa.sa_handler = on_sigchld; sa.sa_flags = SA_RESTART | SA_NOCLDSTOP;
    sigaction(SIGCHLD, &sa, NULL);
    signal(SIGPIPE, SIG_IGN);
    prctl(PR_SET_CHILD_SUBREAPER, 1);
    int oom = open("/proc/self/oom_score_adj", O_WRONLY | O_CLOEXEC);   /* a VM's OOM killer takes a command, */
    if (oom >= 0) { if (write(oom, "-1000", 5) < 0) {} close(oom); }  /* never the agent (the VM with it) */
    privileged = getenv("DSEC_PRIVILEGED") != NULL;
    in_vm = getenv("DSEC_VM") != NULL;
    in_os = getenv("DSEC_OS") != NULL;
    if (in_vm && access("/dev/pts/ptmx", F_OK)) {   /* terminals: a devpts of the guest's own (/dev/ptmx, */
        mkdir("/dev/pts", 0755);                     /* devtmpfs's, opens the one at /dev/pts) */
        if (mount("devpts", "/dev/pts", "devpts", MS_NOSUID | MS_NOEXEC, "newinstance,ptmxmode=0666,mode=0620"))
            fprintf(stderr, "dsec-agent: devpts: %s\n", strerror(errno));
    }
    if (in_os) start_os();     /* before the agent joins its limit groups: systemd's services are not in them */
    procfd = open("/proc", O_RDONLY | O_DIRECTORY | O_CLOEXEC);   /* before gVisor's commands get theirs */
    if (procfd < 0) die("/proc");
    if (!in_vm) start_commands();   /* before too: the spawner and the commands' init count in no limit (the
                                     * sentry charges a fork to its task's own group: with them in the
                                     * sandbox's, a create of pids=2 could not start) */
    limit_pids();
    limit_memory();
    /* gVisor: the group that holds the commands' limit is the agent's alone (pidsfd); its mount point is
     * covered for them, which they cannot undo (no CAP_SYS_ADMIN): a root command raised its own pids.max or
     * moved itself to the root group, then forked past the limit (helper-44). A VM's confine() hides it. */
    if (!in_vm && groups_ok && mount("none", "/dev/.pids", "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC,
                                     "size=4k,mode=000"))
        die("cover /dev/.pids");
    if (in_vm && !privileged && !in_os) make_confined();    /* after the groups: it hides their mounts */
    char host[65] = "";
    if (gethostname(host, sizeof host - 1) == 0) name_host(host, strlen(host));   /* a cold start's name */
    reply('R', 0, NULL, 0, NULL, 0);
    struct pollfd fds[3 + 3 * MAXEXEC];
    struct { struct exec *x; int what; } who[3 * MAXEXEC];
    enum { BASE = 3 };     /* the edge's requests, SIGCHLD, the spawner's reports; then the execs' pipes */
    for (;;) {
        int n = 0, k = 0;
        if (spawn_sock >= 0 && slen && !quiet) from_spawner(0, 0);  /* reports read along with a fork's pid */
        fds[n++] = (struct pollfd){ .fd = 0, .events = POLLIN };
        fds[n++] = (struct pollfd){ .fd = sigpipe[0], .events = quiet ? 0 : POLLIN };
        fds[n++] = (struct pollfd){ .fd = spawn_sock, .events = quiet ? 0 : POLLIN };   /* (-1: ignored) */
        for (int i = 0; i < MAXEXEC && !quiet; i++) {
            struct exec *x = &execs[i];
            if (!x->pid) continue;
            for (int s = 0; s < 2; s++) if (x->out[s] >= 0 && x->inflight < WINDOW) {
                fds[n++] = (struct pollfd){ .fd = x->out[s], .events = POLLIN };
                who[k].x = x; who[k++].what = s;
            }
            if (x->pend) { fds[n++] = (struct pollfd){ .fd = x->in, .events = POLLOUT }; who[k].x = x; who[k++].what = 2; }
        }
        if (poll(fds, (nfds_t)n, -1) < 0) { if (errno == EINTR) continue; die("poll"); }
        if (fds[1].revents) { char b[64]; while (read(sigpipe[0], b, sizeof b) > 0) {} reap(); }
        if (fds[2].revents) from_spawner(1, 0);
        for (int i = BASE; i < n; i++) {
            if (!fds[i].revents) continue;
            struct exec *x = who[i - BASE].x;
            if (!x->pid) continue;
            if (who[i - BASE].what == 2) {
                if (fds[i].revents & (POLLERR | POLLHUP)) stdin_gone(x); else pump_stdin(x);
            } else if (x->out[who[i - BASE].what] == fds[i].fd) {
                read_output(x, who[i - BASE].what);
            }
        }
        if (fds[0].revents) read_requests();
    }
}
