/* dsec-enter: start a command inside a running sandbox, from outside its reach.
 *
 * The edge spawns this static helper with posix_spawn in the host's pid namespace: no process of the
 * sandbox can see, signal, stop or open it in /proc. It enters the sandbox step by step, and only when
 * it holds nothing but the sandbox's namespaces, cgroups and credentials does it make the command's
 * process, the first one the sandbox can see, which at once execs the command:
 *
 *   1. open the exec's cgroup tasks files (as host root: cgroup v1 checks the credentials a file was
 *      opened with); setns ipc, uts, net, mnt, pid (for its children only) and cgroup (the command's
 *      cgroups then read as the sandbox's own, from "/");
 *   2. setns the sandbox's user namespace S and become its root (host uid = the sandbox's range base);
 *      chroot to the sandbox root;
 *   3. clone the command's process into the pid namespace with a user namespace E of its own inside S
 *      (and, for fncall, an IPC namespace of its own). Still root in S, this helper writes the command's
 *      host pid into the tasks files, E's maps (0..65535 of S, through the host's /proc) and says go. The command's process closes every fd
 *      but its stdio and the error pipe, and, holding only the sandbox's namespaces, cgroups and
 *      credentials, takes its cwd, a clean slate (no core dumps, umask, a session keyring), the
 *      seccomp filter, capabilities, its own session, and execs the command;
 *   4. this helper stays the command's parent, out of sight, with every signal blocked (a signal the
 *      edge sends to the exec's processes reaches the command, not it), waits for it and exits the same
 *      way (its exit code, or killed by the same signal), so the edge watches one child of its own. The
 *      command's process first writes "pid:N\n" (its pid in the sandbox) on the error pipe; if
 *      anything in it failed after that, it reports that there too and exits 127. The helper is in none
 *      of the exec's cgroups, so a timeout, which kills the exec's whole cgroup, kills the command and
 *      not it: it reaps the command at once. (When it was in them and killed with it, the command's
 *      zombie went to the host's init, the orphan reaper of the helper's pid namespace, not to the
 *      sandbox's: until that one reaped it, maybe seconds later, the sandbox's init could not end, and
 *      a destroy right after an exec's timeout took about 2 s.)
 *
 * The user namespace E owned by the sandbox's uid is what keeps one exec's leftovers from reading or
 * tracing another's processes (the kernel lets a process ptrace, read /proc/<pid>/fd, mem or environ of
 * another only from the same user namespace or with CAP_SYS_PTRACE there); being nested in S, every
 * per-user kernel count (inotify, user namespaces) is charged to the sandbox's own uid and bounded by
 * S's limits, which the sandbox cannot change.
 *
 *   dsec-enter BASE -- ARGV...    (argv shows nothing of the host: the setup comes on a pipe)
 *   fds: 0-2 stdio; BASE+3 error pipe (write end); BASE+4..BASE+9 ns fds (ipc uts net mnt pid cgroup);
 *   BASE+10 the sandbox's user namespace; BASE+11 sandbox root; BASE+12 the setup pipe (read end),
 *   holding "CAPMASK\0CWD\0CGROUP_TASKS_FILE\0..."; BASE is above every fd the spawner passes, so
 *   its dup2s never clobber a source.
 * The environment is the command's, exactly. On a failure it writes "stage\0errno\0message" to the
 * error pipe and exits 127.
 *
 *   dsec-enter --serve BASE NTASKS   (resident: one per fncall worker, so a call costs one clone)
 *   fds: 0-2 /dev/null; BASE+3 a SOCK_SEQPACKET control socket; BASE+4..BASE+11 as above; BASE+12..
 *   the NTASKS cgroup tasks files every command joins (the worker's x0, opened by the edge). The
 *   server does step 2 once, at its start: it stays in the host's pid namespace (out of every sandbox
 *   process's sight) and in the edge's cgroups (not killed with the commands), and keeps only the
 *   socket, the tasks files and the host's /proc. Per command it only does step 3, writing the
 *   command's host pid into the tasks files before it goes (cgroup v1 checks the credentials the
 *   files were opened with: host root's), and is the command's parent. Each request with fds is an
 *   8-byte id with 5 fds (stdin, stdout, stderr, error pipe, setup pipe); the setup then also holds
 *   the command: "...TASKS\0\0ARGC\0ARGV...\0ENV...\0" (its tasks files are ignored). The server never
 *   waits on anyone: exits come through a signalfd and are sent back as (id, wait status); a command
 *   that could not start is answered as the one-shot helper would exit, 127 with the report on its
 *   error pipe, and a request it has no room for (id, -errno). It exits when the socket closes (the
 *   edge's end: the worker's destroy, or the edge's death).
 *   A collect request (fncall: one packet, no fds) holds a 24-byte header (id, kind 1, the bytes kept
 *   per stream, the stdin length, 8 reserved), the setup, then stdin. The server makes the command's
 *   pipes itself, feeds stdin, keeps at most that many bytes of stdout and stderr each (reading and
 *   dropping the rest), and answers once the command exited and both streams reached EOF: a call
 *   costs the edge one packet out and, for small outputs, one back, instead of pipes, fds and a
 *   reader per stream. Answers are packets of a 16-byte header (id u64, kind u32, value i32) and a
 *   payload: kind 0 the exit status (value; -errno if it could not start), 1/2 a piece of stdout/
 *   stderr, 3 the end of a collect (value the status; payload: flags u32 (bit 0/1: stdout/stderr cut
 *   at the limit), the lengths u32 of the stdout, stderr and error report that follow, then them).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <linux/audit.h>
#include <linux/capability.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <sched.h>
#include <signal.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#define NS_COUNT 6
#define SETUP_MAX (1 << 20)   /* what a setup may hold (serve mode: with argv and env) */
#define ARGS_MAX 65536
static int ERR_FD = 2;

/* An error report, "stage\0errno\0what: strerror", on fd (what the edge reads as the reason). */
static void report(int fd, const char *stage, int e, const char *what) {
    char buf[512];
    int n = snprintf(buf, sizeof buf, "%s%c%d%c%s: %s", stage, 0, e, 0, what, strerror(e));
    if (n > 0) (void)!write(fd, buf, (size_t)n < sizeof buf ? (size_t)n : sizeof buf);
}

static void fail(const char *stage, const char *what) {
    report(ERR_FD, stage, errno, what);
    _exit(127);
}

/* The seccomp filter of every command. Refused:
 *  - user namespaces: unshare/clone with CLONE_NEWUSER fail with EPERM; clone3, whose flags a filter
 *    cannot read, fails with ENOSYS, so libc falls back to clone (as Docker does). Each exec's own
 *    namespace is made here, before the filter;
 *  - netlink uevent sockets (NETLINK_KOBJECT_UEVENT: the host's hotplug events): EPERM;
 *  - vsock sockets (AF_VSOCK, as Docker's default profile): no namespace holds them, so a sandbox reached the
 *    host's hypervisor and its services (CID 2) past its network namespace (helper-44): EPERM;
 *  - the page-cache probe on shared layers: mincore, and posix_fadvise(POSIX_FADV_DONTNEED): EPERM;
 *  - sync(2), which would flush every filesystem of the host: a no-op returning success (fsync,
 *    fdatasync and syncfs of the sandbox's own files still work);
 *  - sched_setaffinity: a no-op returning success (as gVisor keeps a mask of its own and pins nothing):
 *    threads moving themselves from CPU to CPU every few hundred us make the kernel's migration threads,
 *    which run above every class and outside every cgroup, take the node (exec round trips of seconds);
 *    sched_getaffinity tells the truth (the sandbox's cpuset), and taskset-wrapped commands still run;
 *  - io_uring (setup, enter, register): EPERM, as Docker's default profile has it since 2023: a large
 *    kernel surface with a history of privilege escalations, and programs fall back to plain calls;
 *  - native AIO contexts (io_setup): ENOSYS, as a kernel without AIO says (libaio's users, InnoDB among
 *    them, fall back to threads): the host has one table of them (fs.aio-max-nr, 65,536 events), which
 *    one sandbox filled in a second for every process of the host (helper A2);
 *  - the x32 ABI; on i386, socketcall (whose arguments a filter cannot read: ENOSYS, so libc uses the
 *    direct socket call, checked like x86_64's).
 * Written with labels, resolved below, so a jump is never counted by hand. */
enum { L_X86, L_I386, L_FLAGS, L_SOCKET, L_FADV64, L_FADV_ARG4, L_FADV_ARG5, L_ENOSYS, L_EPERM, L_NOOP, L_ALLOW, L_COUNT };
#define MAX_INS 64
static struct sock_filter prog[MAX_INS];
static int n_ins, label_at[L_COUNT], jt_of[MAX_INS], jf_of[MAX_INS];
static void ins(unsigned short code, unsigned int k) { prog[n_ins].code = code; prog[n_ins].k = k; jt_of[n_ins] = jf_of[n_ins] = -1; n_ins++; }
/* jump if A == k (or JSET/JGE) to label jt, else to label jf (-1: the next instruction) */
static void jmp(unsigned short op, unsigned int k, int jt, int jf) { ins(BPF_JMP | op | BPF_K, k); jt_of[n_ins - 1] = jt; jf_of[n_ins - 1] = jf; }
static void label(int l) { label_at[l] = n_ins; }
static void ret(unsigned int v) { ins(BPF_RET | BPF_K, v); }
static void load(unsigned int off) { ins(BPF_LD | BPF_W | BPF_ABS, off); }

static struct sock_fprog filter;   /* built once, at the start (build_filter), loaded by each command */

static void build_filter(void) {
    const unsigned int NR = offsetof(struct seccomp_data, nr), ARCH = offsetof(struct seccomp_data, arch);
    const unsigned int ARG0 = offsetof(struct seccomp_data, args[0]), ARG2 = offsetof(struct seccomp_data, args[2]);
    const unsigned int ARG3 = offsetof(struct seccomp_data, args[3]), ARG4 = offsetof(struct seccomp_data, args[4]);
    const unsigned int ARG5 = offsetof(struct seccomp_data, args[5]);
    load(ARCH);
    jmp(BPF_JEQ, AUDIT_ARCH_X86_64, L_X86, -1);
    jmp(BPF_JEQ, AUDIT_ARCH_I386, L_I386, L_ALLOW);
    label(L_X86);
    load(NR);
    jmp(BPF_JGE, 0x40000000, L_ENOSYS, -1);          /* x32 */
    jmp(BPF_JEQ, 435 /* clone3 */, L_ENOSYS, -1);
    jmp(BPF_JEQ, 272 /* unshare */, L_FLAGS, -1);
    jmp(BPF_JEQ, 56 /* clone */, L_FLAGS, -1);
    jmp(BPF_JEQ, 41 /* socket */, L_SOCKET, -1);
    jmp(BPF_JEQ, 27 /* mincore */, L_EPERM, -1);
    jmp(BPF_JEQ, 221 /* fadvise64 */, L_FADV64, -1);
    jmp(BPF_JEQ, 425 /* io_uring_setup */, L_EPERM, -1);
    jmp(BPF_JEQ, 426 /* io_uring_enter */, L_EPERM, -1);
    jmp(BPF_JEQ, 427 /* io_uring_register */, L_EPERM, -1);
    jmp(BPF_JEQ, 206 /* io_setup */, L_ENOSYS, -1);
    jmp(BPF_JEQ, 203 /* sched_setaffinity */, L_NOOP, -1);
    jmp(BPF_JEQ, 162 /* sync */, L_NOOP, L_ALLOW);
    label(L_I386);
    load(NR);
    jmp(BPF_JEQ, 435 /* clone3 */, L_ENOSYS, -1);
    jmp(BPF_JEQ, 102 /* socketcall */, L_ENOSYS, -1);
    jmp(BPF_JEQ, 310 /* unshare */, L_FLAGS, -1);
    jmp(BPF_JEQ, 120 /* clone */, L_FLAGS, -1);
    jmp(BPF_JEQ, 359 /* socket */, L_SOCKET, -1);
    jmp(BPF_JEQ, 218 /* mincore */, L_EPERM, -1);
    jmp(BPF_JEQ, 250 /* fadvise64: advice is args[4] */, L_FADV_ARG4, -1);
    jmp(BPF_JEQ, 272 /* fadvise64_64: advice is args[5] */, L_FADV_ARG5, -1);
    jmp(BPF_JEQ, 425 /* io_uring_setup */, L_EPERM, -1);
    jmp(BPF_JEQ, 426 /* io_uring_enter */, L_EPERM, -1);
    jmp(BPF_JEQ, 427 /* io_uring_register */, L_EPERM, -1);
    jmp(BPF_JEQ, 245 /* io_setup */, L_ENOSYS, -1);
    jmp(BPF_JEQ, 241 /* sched_setaffinity */, L_NOOP, -1);
    jmp(BPF_JEQ, 36 /* sync */, L_NOOP, L_ALLOW);
    label(L_FLAGS);                                   /* clone/unshare flags: low half of args[0] */
    load(ARG0);
    jmp(BPF_JSET, CLONE_NEWUSER, L_EPERM, L_ALLOW);
    label(L_SOCKET);                                  /* socket(AF_NETLINK, *, NETLINK_KOBJECT_UEVENT) */
    load(ARG0);
    jmp(BPF_JEQ, 40 /* AF_VSOCK */, L_EPERM, -1);
    jmp(BPF_JEQ, 16 /* AF_NETLINK */, -1, L_ALLOW);
    load(ARG2);
    jmp(BPF_JEQ, 15 /* NETLINK_KOBJECT_UEVENT */, L_EPERM, L_ALLOW);
    label(L_FADV64);                                  /* fadvise64(fd, offset, len, advice) */
    load(ARG3);
    jmp(BPF_JEQ, 4 /* POSIX_FADV_DONTNEED */, L_EPERM, L_ALLOW);
    label(L_FADV_ARG4);
    load(ARG4);
    jmp(BPF_JEQ, 4, L_EPERM, L_ALLOW);
    label(L_FADV_ARG5);
    load(ARG5);
    jmp(BPF_JEQ, 4, L_EPERM, L_ALLOW);
    label(L_ENOSYS);
    ret(SECCOMP_RET_ERRNO | ENOSYS);
    label(L_EPERM);
    ret(SECCOMP_RET_ERRNO | EPERM);
    label(L_NOOP);
    ret(SECCOMP_RET_ERRNO | 0);
    label(L_ALLOW);
    ret(SECCOMP_RET_ALLOW);
    for (int i = 0; i < n_ins; i++) {
        if (jt_of[i] == -1 && jf_of[i] == -1) continue;
        int jt = jt_of[i] < 0 ? i + 1 : label_at[jt_of[i]], jf = jf_of[i] < 0 ? i + 1 : label_at[jf_of[i]];
        if (jt - i - 1 > 255 || jf - i - 1 > 255 || jt <= i || jf <= i) { errno = EINVAL; fail("setup", "seccomp program"); }
        prog[i].jt = (unsigned char)(jt - i - 1);
        prog[i].jf = (unsigned char)(jf - i - 1);
    }
    filter = (struct sock_fprog){(unsigned short)n_ins, prog};
}

static void command_filter(void) {
    if (prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &filter, 0, 0)) fail("setup", "seccomp");
}

/* Capabilities down to keep (bounding, ambient, and the sets). No no_new_privs: the image's setuid
 * programs (su, ping, sudo) work as they do in any container, within the bounding set, and as the
 * sandbox's own ids only (a setuid-root file inside is owned by the sandbox's root, a host uid of its
 * range: nothing it gains is privileged on the host). */
static int last_cap = 63;   /* /proc/sys/kernel/cap_last_cap, read at the start */

static void lockdown(unsigned long long keep) {
    for (int cap = 0; cap <= last_cap; cap++) {
        if (keep & (1ULL << cap)) continue;
        if (prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) && errno != EINVAL) fail("setup", "capbset");
    }
    prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0);
    struct __user_cap_header_struct hdr = {_LINUX_CAPABILITY_VERSION_3, 0};
    struct __user_cap_data_struct data[2];
    for (int i = 0; i < 2; i++) {
        unsigned int m = (unsigned int)(keep >> (32 * i));
        data[i].effective = data[i].permitted = data[i].inheritable = m;
    }
    if (syscall(SYS_capset, &hdr, data)) fail("setup", "capset");
}

/* Search PATH with execve only: unlike execvp, a file without a #! line fails (ENOEXEC) instead of
 * being run by the image's /bin/sh, which the sandbox may have replaced. A candidate is looked up
 * before it is tried: an execve that fails costs ~60 us here (most of a call's start when the command
 * is in the last of six directories), a lookup a few. */
static void exec_path(char **cmd, char **envp) {
    if (strchr(cmd[0], '/')) { execve(cmd[0], cmd, envp); return; }
    const char *path = NULL;
    for (char **e = envp; *e; e++)
        if (strncmp(*e, "PATH=", 5) == 0) path = *e + 5;
    if (!path) path = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
    int seen_eacces = 0;
    char buf[4096];
    for (const char *p = path; ; ) {
        const char *end = strchr(p, ':');
        size_t len = end ? (size_t)(end - p) : strlen(p);
        int n = snprintf(buf, sizeof buf, "%.*s/%s", (int)len, len ? p : ".", cmd[0]);
        struct stat st;
        if (n > 0 && (size_t)n < sizeof buf && stat(buf, &st) == 0) {
            execve(buf, cmd, envp);
            if (errno == EACCES) seen_eacces = 1;
            else if (errno != ENOENT && errno != ENOTDIR) return;     /* e.g. ENOEXEC: report it */
        } else if (n > 0 && (size_t)n < sizeof buf) {
            if (errno == EACCES) seen_eacces = 1;                      /* a directory it may not search */
            else if (errno != ENOENT && errno != ENOTDIR) { execve(buf, cmd, envp); return; }   /* its own error */
        }
        if (!end) break;
        p = end + 1;
    }
    errno = seen_eacces ? EACCES : ENOENT;
}

/* What a command inherits besides its environment is set here, not taken from the edge: no core
 * dumps (hard limit 0: a process of another exec, same uid, could otherwise raise the limit and
 * make this one dump its memory into the sandbox), umask 022, a session keyring of its own. */
static void clean_slate(void) {
    struct rlimit none = {0, 0};
    if (setrlimit(RLIMIT_CORE, &none)) fail("setup", "rlimit core");
    umask(022);
    struct rlimit nice = {0, 0};                   /* no way back from SCHED_IDLE, nor below nice 0 */
    if (setrlimit(RLIMIT_NICE, &nice)) fail("setup", "rlimit nice");
    syscall(SYS_keyctl, 1 /* KEYCTL_JOIN_SESSION_KEYRING */, (char *)NULL);   /* none on kernels without keys */
}

/* What one command is: "CAPMASK[,ipc][,idle][,tty][,u=UID:GID[:GROUP...]]\0CWD\0TASKS...\0" (each
 * \0-terminated, an empty one ends the tasks files; ",ipc": an IPC namespace of its own, so no SysV object
 * outlives a fncall call; ",idle": at SCHED_IDLE (a batch sandbox's); ",tty": its stdin is a terminal of the
 * sandbox's own devpts, made its controlling terminal; ",u=": run as that uid, gid and supplementary groups of
 * the sandbox, not its root), and in serve mode "\0ARGC\0ARGV...\0ENV...\0" after it. */
#define GROUPS_MAX 64
struct command_line {
    unsigned long long keep;
    int fresh_ipc, idle, tty;
    int as_user, ngroups;
    uid_t uid;
    gid_t gid, groups[GROUPS_MAX];
    const char *cwd;
    char *tasks, *tasks_end;
    char **argv, **envp;
};

static char setup[SETUP_MAX];
static char stack[64 << 10] __attribute__((aligned(16)));
static char *served_argv[ARGS_MAX + 1], *served_env[ARGS_MAX + 1];

/* Read the setup pipe whole (until EOF), NUL-terminated; its length, or -1 (errno). */
static long read_setup(int fd) {
    size_t got = 0;
    for (ssize_t n; got < sizeof setup - 1 && (n = read(fd, setup + got, sizeof setup - 1 - got)) != 0; ) {
        if (n < 0) { if (errno == EINTR) continue; return -1; }
        got += (size_t)n;
    }
    setup[got] = 0;
    return (long)got;
}

/* Parse setup[0..got] into c (with_command: serve mode, argv and env in it); NULL, or what is wrong. */
static const char *parse_setup(size_t got, int with_command, struct command_line *c) {
    char *p = setup, *end = setup + got, *flags = NULL;
    c->keep = strtoull(p, &flags, 0);
    c->fresh_ipc = 0;
    c->idle = 0;
    c->tty = 0;
    c->as_user = 0;
    c->ngroups = 0;
    for (char *f = flags; f && *f == ','; ) {
        f++;
        if (strncmp(f, "ipc", 3) == 0 && (f[3] == ',' || !f[3])) { c->fresh_ipc = 1; f += 3; continue; }
        if (strncmp(f, "idle", 4) == 0 && (f[4] == ',' || !f[4])) { c->idle = 1; f += 4; continue; }
        if (strncmp(f, "tty", 3) == 0 && (f[3] == ',' || !f[3])) { c->tty = 1; f += 3; continue; }
        if (strncmp(f, "u=", 2) != 0) return "setup: unknown flag";
        char *q = f + 2;
        unsigned long v[GROUPS_MAX + 2];
        int n = 0;
        for (;;) {
            char *e;
            errno = 0;
            v[n] = strtoul(q, &e, 10);
            if (e == q || errno || v[n] > 65535) return "setup: bad user";
            n++;
            q = e;
            if (*q != ':' || n == GROUPS_MAX + 2) break;
            q++;
        }
        if (n < 2) return "setup: a user needs uid:gid";
        c->as_user = 1;
        c->uid = (uid_t)v[0];
        c->gid = (gid_t)v[1];
        for (int k = 2; k < n; k++) c->groups[c->ngroups++] = (gid_t)v[k];
        f = q;
    }
    p += strlen(p) + 1;
    if (p >= end) return "setup without cwd";
    c->cwd = p;
    p += strlen(p) + 1;
    c->tasks = p;
    while (p < end && *p) p += strlen(p) + 1;
    c->tasks_end = p;
    if (!with_command) return NULL;
    if (p >= end) return "setup without a command";
    p++;
    long argc = strtol(p, NULL, 10);
    p += strlen(p) + 1;
    if (argc < 1 || argc > ARGS_MAX) return "setup: bad argument count";
    for (long i = 0; i < argc; i++) {
        if (p >= end) return "setup: arguments cut short";
        served_argv[i] = p;
        p += strlen(p) + 1;
    }
    served_argv[argc] = NULL;
    int n = 0;
    for (; p < end && n < ARGS_MAX; p += strlen(p) + 1) served_env[n++] = p;
    served_env[n] = NULL;
    c->argv = served_argv;
    c->envp = served_env;
    return NULL;
}

/* Step 2 (and the rest of 1): the sandbox's namespaces (fds at ns_fd0.., its user namespace at userns_fd)
 * as its root, chrooted to root_fd. NULL, or the stage that failed (errno). */
static const char *enter_sandbox(int ns_fd0, int userns_fd, int root_fd) {
    for (int k = 0; k < NS_COUNT; k++)
        if (setns(ns_fd0 + k, 0)) return "setns";
    if (setns(userns_fd, CLONE_NEWUSER)) return "setns user";
    if (setgroups(0, NULL) || setresgid(0, 0, 0) || setresuid(0, 0, 0)) return "sandbox root";
    /* the uid change made this process non-dumpable, and so would be the command's process, whose /proc
       files would then belong to host root, out of reach for its maps. This process is out of every
       sandbox process's sight (host pid namespace) either way. */
    if (prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)) return "dumpable";
    if (fchdir(root_fd) || chroot(".")) return "chroot";
    return NULL;
}

/* The command's process (step 3): a clone of its parent in E sharing its memory until it execs (as
 * posix_spawn's child does: no page tables copied, none torn down at the exec), holding at 0-2 its
 * stdio, at 3 the error pipe, at 4 the go pipe and at 5 the exec pipe (all else closed). It takes a
 * clean slate, its filter and capabilities while its parent writes E's maps and puts it into its
 * cgroups, waits for the go, enters its cwd and execs; the exec (or its death) closes the exec pipe,
 * which the parent waits for before it goes on. Until then the parent touches nothing the child uses
 * (its stack, child_line, the filter) and reads no global the child writes (ERR_FD and environ are put
 * back after); errno, which they share, each reads only after a failure of its own, when the command
 * is not run anyway (at worst its report names the wrong errno). */
#define OOM_SCORE_ADJ "500"
static const struct command_line *child_line;
static sigset_t child_mask;
static int child_fds[6];
/* Where a new process first runs. Left free, the kernel often put it on another CPU busy with a sandbox's
 * work (SCHED_IDLE work counts as idle there), where it waited its turn, up to a tick (~4 ms here), while
 * the CPU of its parent, about to sleep, idled. So the edge spawns this helper bound to the CPU it runs on
 * (kernel.py, on_this_cpu), and this helper binds itself there again while it clones the command. The
 * one-shot helper drops the edge's binding at its start, the command drops its own before its seccomp filter
 * (to every CPU: the sandbox's cpuset bounds it; the kernel may move it at the exec, and its forks inherit
 * no binding), and after the clone this helper puts back what it had. Only a hint: failures are ignored. */
static cpu_set_t before_pin;     /* this helper's own binding, put back after its clone (a resident server's
                                   is the edge's, which an operator may have set) */
static int pinned;

static void pin_here(void) {
    int cpu = sched_getcpu();
    if (cpu < 0 || sched_getaffinity(0, sizeof before_pin, &before_pin)) return;
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(cpu, &one);
    pinned = !sched_setaffinity(0, sizeof one, &one);
}

static void unpin_self(void) {
    if (pinned) sched_setaffinity(0, sizeof before_pin, &before_pin);
    pinned = 0;
}

static void unpin(void) {      /* the command: every CPU (its sandbox's cpuset bounds it) */
    cpu_set_t every;
    memset(&every, 0xff, sizeof every);
    sched_setaffinity(0, sizeof every, &every);
}

static int command(void *unused) {
    (void)unused;
    char c;
    int high[6];
    for (int i = 0; i < 6; i++)
        if ((high[i] = fcntl(child_fds[i], F_DUPFD_CLOEXEC, 6)) < 0) _exit(127);
    for (int i = 0; i < 6; i++)
        if (dup3(high[i], i, i >= 3 ? O_CLOEXEC : 0) < 0) _exit(127);
    if (syscall(SYS_close_range, 6, ~0U, 0)) {
        long max = sysconf(_SC_OPEN_MAX);          /* no close_range (old kernel): close one by one */
        for (long fd = 6; fd < (max > 0 ? max : 65536); fd++) close((int)fd);
    }
    ERR_FD = 3;                                    /* (the parent's copy is put back: we share its memory) */
    setsid();           /* own session (and autogroup) at once: kill(0) or /dev/tty never reach anyone else's */
    if (child_line->tty && ioctl(0, TIOCSCTTY, 0)) fail("setup", "controlling terminal");
    /* What needs neither E's maps nor the cgroups is done while the parent writes them: the clean slate,
     * the filter (root of E with CAP_SYS_ADMIN there from the clone on: no no_new_privs needed for it)
     * and the capabilities. Nothing here fails but for want of memory or a kernel feature. */
    clean_slate();
    unpin();            /* (before the filter, which makes sched_setaffinity a no-op; it already runs here) */
    if (child_line->idle) {                  /* a batch sandbox's command (and its forks): SCHED_IDLE */
        struct sched_param none = {0};
        if (sched_setscheduler(0, SCHED_IDLE, &none)) fail("setup", "SCHED_IDLE");
    }
    command_filter();
    lockdown(child_line->keep);
    ssize_t n;
    while ((n = read(4, &c, 1)) < 0 && errno == EINTR) {}
    if (n != 1) _exit(127);                      /* the parent died, or could not write the maps */
    close(4);
    char started[24];                            /* "pid:N\n" first on the error pipe: its pid in the sandbox */
    int len = snprintf(started, sizeof started, "pid:%d\n", (int)getpid());
    if (write(3, started, (size_t)len) != len) _exit(127);
    if (child_line->as_user) {                   /* a user of the image: its groups, gid, uid (its caps go) */
        if (setgroups((size_t)child_line->ngroups, child_line->groups)) fail("user", "setgroups");
        if (setresgid(child_line->gid, child_line->gid, child_line->gid)) fail("user", "setgid");
        if (setresuid(child_line->uid, child_line->uid, child_line->uid)) fail("user", "setuid");
    }
    if (chdir(child_line->cwd)) fail("cwd", child_line->cwd);   /* as root of E now (its maps written) */
    sigprocmask(SIG_SETMASK, &child_mask, NULL);
    environ = child_line->envp;
    exec_path(child_line->argv, child_line->envp);
    if (!errno) errno = ENOEXEC;
    fail("exec", child_line->argv[0]);
    return 127;
}

static int write_proc(int proc_fd, pid_t pid, const char *which, const char *text) {
    char path[64];
    snprintf(path, sizeof path, "%d/%s", (int)pid, which);
    int fd = openat(proc_fd, path, O_WRONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    ssize_t len = (ssize_t)strlen(text), n = write(fd, text, (size_t)len);
    int e = errno;
    close(fd);
    errno = e;
    return n == len ? 0 : -1;
}

/* Step 3, from a process already inside (step 2): clone the command's process with stdio at 0-2 and
 * err_w as its error pipe, put it into the cgroups of the tasks fds (its host pid written there; none
 * when the caller joined them itself), write E's maps through the host's /proc (proc_fd) and let it
 * go. Its host pid, or -1 with errno and *what saying which step failed (nothing left running). */
static pid_t spawn_command(const struct command_line *c, const int stdio[3], int err_w, int proc_fd,
                           const int *tasks, int ntasks, const char **what) {
    int go[2], execd[2];
    if (pipe2(go, O_CLOEXEC)) { *what = "go pipe"; return -1; }
    if (pipe2(execd, O_CLOEXEC)) { close(go[0]); close(go[1]); *what = "exec pipe"; return -1; }
    child_line = c;
    child_fds[0] = stdio[0]; child_fds[1] = stdio[1]; child_fds[2] = stdio[2];
    child_fds[3] = err_w; child_fds[4] = go[0]; child_fds[5] = execd[1];
    const int err_fd = ERR_FD;
    char **const env = environ;
    pin_here();
    pid_t pid = clone(command, stack + sizeof stack,
                      CLONE_VM | CLONE_NEWUSER | (c->fresh_ipc ? CLONE_NEWIPC : 0) | SIGCHLD, NULL);
    int e = errno;
    unpin_self();
    close(go[0]);
    close(execd[1]);
    if (pid < 0) {
        close(go[1]);
        close(execd[0]);
        errno = e;
        *what = e == ENOSPC ? "clone: a new user namespace" : "clone";
        return -1;
    }
    char text[16];
    int len = snprintf(text, sizeof text, "%d", (int)pid);
    *what = NULL;
    for (int k = 0; k < ntasks && !*what; k++)
        if (write(tasks[k], text, (size_t)len) != len) *what = "join cgroup";
    if (!*what && (write_proc(proc_fd, pid, "uid_map", "0 0 65536") || write_proc(proc_fd, pid, "gid_map", "0 0 65536")))
        *what = "user namespace map";
    /* The OOM killer's first choice is any command before the sandbox's init (0, ~0.7 MiB: host root here
       may not lower it, CAP_SYS_RESOURCE): killed, the init ends the sandbox. A command may lower its own
       back to 0, and then only risks its own sandbox. */
    if (!*what && write_proc(proc_fd, pid, "oom_score_adj", OOM_SCORE_ADJ))
        *what = "oom_score_adj";
    if (!*what && write(go[1], "g", 1) != 1) *what = "go";
    e = errno;
    close(go[1]);
    if (*what)
        kill(pid, SIGKILL);
    char b;
    while (read(execd[0], &b, 1) < 0 && errno == EINTR) {}   /* until it has exec'd or died: our memory again */
    close(execd[0]);
    ERR_FD = err_fd;
    environ = env;
    if (*what) {
        int status;
        while (waitpid(pid, &status, __WALL) < 0 && errno == EINTR) {}
        errno = e;
        return -1;
    }
    return pid;
}

/* The one-shot way (steps 1-4), in the helper the edge spawned, holding at BASE+3..BASE+12 the error
 * pipe, the namespace fds, the root and the setup pipe. Never returns: exits the way the command did. */
static void enter_and_run(int base, char **cmd, char **envp) {
    unpin();            /* spawned bound to the edge's CPU (on_this_cpu): free again, but for the clone */
    ERR_FD = base + 3;
    const int NS_FD0 = base + 4, USERNS_FD = base + 10, ROOT_FD = base + 11, SETUP_FD = base + 12;
    long got = read_setup(SETUP_FD);
    if (got < 0) fail("setup", "read setup");
    struct command_line c;
    const char *bad = parse_setup((size_t)got, 0, &c);
    if (bad) { errno = EINVAL; fail("setup", bad); }
    c.argv = cmd;
    c.envp = envp;
    int proc_fd = open("/proc", O_PATH | O_DIRECTORY | O_CLOEXEC);   /* the host's: E's maps by host pid */
    if (proc_fd < 0) fail("setup", "/proc");
    int tasks[16], ntasks = 0;   /* the command's cgroups, joined by it alone (step 3) */
    for (const char *p = c.tasks; p < c.tasks_end; p += strlen(p) + 1) {
        if (ntasks == (int)(sizeof tasks / sizeof *tasks)) { errno = E2BIG; fail("setup", "join cgroup"); }
        if ((tasks[ntasks++] = open(p, O_WRONLY | O_CLOEXEC)) < 0) fail("setup", "join cgroup");
    }
    const char *stage = enter_sandbox(NS_FD0, USERNS_FD, ROOT_FD);
    if (stage) fail("setup", stage);
    const int stdio[3] = {0, 1, 2};
    const char *what;
    pid_t pid = spawn_command(&c, stdio, ERR_FD, proc_fd, tasks, ntasks, &what);
    if (pid < 0) fail("setup", what);
    for (int k = 0; k < ntasks; k++) close(tasks[k]);
    close(ERR_FD);                                  /* the command's process holds it until it execs */
    for (int fd = 0; fd < 3; fd++) close(fd);       /* the command's stdio is the command's alone */
    int status = 0;
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {}
    if (WIFSIGNALED(status)) {                      /* die the way it died */
        int sig = WTERMSIG(status);
        struct sigaction dfl = {.sa_handler = SIG_DFL};
        sigaction(sig, &dfl, NULL);
        sigset_t one;
        sigemptyset(&one);
        sigaddset(&one, sig);
        kill(getpid(), sig);
        sigprocmask(SIG_UNBLOCK, &one, NULL);
        _exit(128 + sig);                            /* a signal that does not kill (none here) */
    }
    _exit(WIFEXITED(status) ? WEXITSTATUS(status) : 127);
}

/* ---- serve mode ---------------------------------------------------------------------------------- */

#define SERVE_FDS 5          /* stdin, stdout, stderr, error pipe, setup pipe */
#define SERVE_SLOTS 256      /* commands in flight at once */
#define COLLECT_MAX (128 << 10)   /* the most a collect request may hold (header, setup, stdin) */
#define COLLECT_HEAD 24
#define CHUNK (64 << 10)
#define PEND (16 << 10)      /* output held back per stream, to go with the end (one packet for small calls) */
#define REPORT_MAX 4096
enum { ANS_EXIT = 0, ANS_STDOUT = 1, ANS_STDERR = 2, ANS_END = 3 };
static struct slot {
    pid_t pid;
    uint64_t id;
    int collect, reaped, status;
    int in_fd, out_fd[2], err_fd;        /* the server's ends (-1: closed); out_fd: stdout, stderr */
    char *in_buf;
    size_t in_len, in_off, max_output, kept[2], pend_len[2];
    int cut[2];
    char pend[2][PEND];
} *running[SERVE_SLOTS];
static char request[COLLECT_MAX];
static char chunk[CHUNK];

static void packet(int sock, uint64_t id, uint32_t kind, int32_t value, const struct iovec *body, int nbody) {
    struct { uint64_t id; uint32_t kind; int32_t value; } head = {id, kind, value};
    struct iovec iov[6] = {{&head, sizeof head}};
    for (int i = 0; i < nbody && i < 5; i++) iov[1 + i] = body[i];
    struct msghdr mh = {.msg_iov = iov, .msg_iovlen = (size_t)(1 + (nbody < 5 ? nbody : 5))};
    while (sendmsg(sock, &mh, MSG_NOSIGNAL) < 0 && errno == EINTR) {}
}

static void answer(int sock, uint64_t id, int32_t status) { packet(sock, id, ANS_EXIT, status, NULL, 0); }

static void close_fd(int *fd) { if (*fd >= 0) close(*fd); *fd = -1; }

/* A piece of a stream: kept up to the limit (held back while it fits, else sent on), the rest dropped. */
static void take_output(int sock, struct slot *sl, int s, const char *data, size_t n) {
    size_t room = sl->max_output - sl->kept[s], take = n < room ? n : room;
    if (take < n) sl->cut[s] = 1;
    sl->kept[s] += take;
    if (sl->pend_len[s] + take > PEND && sl->pend_len[s]) {
        struct iovec b = {sl->pend[s], sl->pend_len[s]};
        packet(sock, sl->id, ANS_STDOUT + s, 0, &b, 1);
        sl->pend_len[s] = 0;
    }
    if (take > PEND) {
        struct iovec b = {(void *)data, take};
        packet(sock, sl->id, ANS_STDOUT + s, 0, &b, 1);
    } else if (take) {
        memcpy(sl->pend[s] + sl->pend_len[s], data, take);
        sl->pend_len[s] += take;
    }
}

/* A collect whose command exited and whose streams ended: its end, with what was held back. */
static void finish(int sock, int i) {
    struct slot *sl = running[i];
    char report[REPORT_MAX];
    ssize_t r = read(sl->err_fd, report, sizeof report);
    close_fd(&sl->err_fd);
    close_fd(&sl->in_fd);
    uint32_t meta[4] = {(uint32_t)(sl->cut[0] | sl->cut[1] << 1), (uint32_t)sl->pend_len[0],
                        (uint32_t)sl->pend_len[1], (uint32_t)(r > 0 ? r : 0)};
    struct iovec body[4] = {{meta, sizeof meta}, {sl->pend[0], sl->pend_len[0]}, {sl->pend[1], sl->pend_len[1]},
                            {report, (size_t)(r > 0 ? r : 0)}};
    packet(sock, sl->id, ANS_END, sl->status, body, 4);
    free(sl->in_buf);
    free(sl);
    running[i] = NULL;
}

static int free_slot(void) {
    for (int i = 0; i < SERVE_SLOTS; i++)
        if (!running[i]) return i;
    return -1;
}

/* What the server holds once inside (serve_enter): the host's /proc, and the x0 tasks files. */
static int serve_proc_fd = -1, serve_tasks[16], serve_ntasks;

/* A command of a request whose setup is in setup[0..got] (parsed here), with stdio and err_w (all the
 * server's copies, closed here): its host pid, or -1 with its error report written to err_w (the
 * one-shot helper's "stage\0errno\0message") and err_w closed. */
static pid_t start_command(size_t got, const int stdio[3], int err_w) {
    struct command_line c;
    const char *what = parse_setup(got, 1, &c);
    int e = EINVAL;
    pid_t pid = -1;
    if (!what) {
        pid = spawn_command(&c, stdio, err_w, serve_proc_fd, serve_tasks, serve_ntasks, &what);
        e = errno;
    }
    for (int k = 0; k < 3; k++) close(stdio[k]);
    if (pid < 0)
        report(err_w, "setup", e, what);
    close(err_w);
    return pid;
}

/* A request with fds (stdin, stdout, stderr, error pipe, setup pipe): the edge pumps the streams. A
 * command that could not start is answered as the one-shot helper exits then: 127, the report on its
 * error pipe. */
static void start_one(int sock, uint64_t id, int *fds) {
    int i = free_slot();
    struct slot *sl = i < 0 ? NULL : calloc(1, sizeof *sl);
    long got = sl ? read_setup(fds[4]) : -1;
    int e = errno;
    close(fds[4]);
    if (got < 0) {
        for (int k = 0; k < 4; k++) close(fds[k]);
        free(sl);
        answer(sock, id, sl ? -e : -EAGAIN);
        return;
    }
    pid_t pid = start_command((size_t)got, fds, fds[3]);
    if (pid < 0) { free(sl); answer(sock, id, 127 << 8); return; }
    sl->pid = pid;
    sl->id = id;
    sl->in_fd = sl->out_fd[0] = sl->out_fd[1] = sl->err_fd = -1;
    running[i] = sl;
}

/* A collect request (see the top): the pipes made here, the setup taken from the packet. */
static void start_collect(int sock, uint64_t id, size_t n) {
    uint32_t max_output, in_len;
    memcpy(&max_output, request + 12, 4);
    memcpy(&in_len, request + 16, 4);
    if (n < COLLECT_HEAD || in_len > n - COLLECT_HEAD || n - COLLECT_HEAD - in_len >= sizeof setup) {
        answer(sock, id, -EINVAL);
        return;
    }
    size_t setup_len = n - COLLECT_HEAD - in_len;
    int i = free_slot();
    struct slot *sl = i < 0 ? NULL : calloc(1, sizeof *sl);
    if (!sl) { answer(sock, id, -EAGAIN); return; }
    sl->in_fd = sl->out_fd[0] = sl->out_fd[1] = sl->err_fd = -1;
    int in[2] = {-1, -1}, out[2] = {-1, -1}, err[2] = {-1, -1}, rep[2] = {-1, -1};
    if (pipe2(in, O_CLOEXEC) || pipe2(out, O_CLOEXEC) || pipe2(err, O_CLOEXEC) || pipe2(rep, O_CLOEXEC)) {
        int e = errno;
        close_fd(&in[0]); close_fd(&in[1]); close_fd(&out[0]); close_fd(&out[1]);
        close_fd(&err[0]); close_fd(&err[1]); close_fd(&rep[0]); close_fd(&rep[1]);
        free(sl);
        answer(sock, id, -e);
        return;
    }
    memcpy(setup, request + COLLECT_HEAD, setup_len);
    setup[setup_len] = 0;
    const int stdio[3] = {in[0], out[1], err[1]};
    pid_t pid = start_command(setup_len, stdio, rep[1]);
    sl->id = id;
    sl->collect = 1;
    sl->max_output = max_output;
    sl->out_fd[0] = out[0];
    sl->out_fd[1] = err[0];
    sl->err_fd = rep[0];
    fcntl(out[0], F_SETFL, O_NONBLOCK);
    fcntl(err[0], F_SETFL, O_NONBLOCK);
    fcntl(rep[0], F_SETFL, O_NONBLOCK);
    sl->in_fd = in[1];
    if (pid < 0) {                     /* its end at once: exit 127 and the report (streams at EOF) */
        sl->pid = -1;
        sl->reaped = 1;
        sl->status = 127 << 8;
        close_fd(&sl->in_fd);
    } else if (in_len && (sl->in_buf = malloc(in_len))) {
        sl->pid = pid;
        memcpy(sl->in_buf, request + COLLECT_HEAD + setup_len, in_len);
        sl->in_len = in_len;
        fcntl(in[1], F_SETFL, O_NONBLOCK);
    } else {
        sl->pid = pid;
        close_fd(&sl->in_fd);          /* no stdin: EOF at once */
    }
    running[i] = sl;
}

/* The server's start: holding at BASE+3 its socket, BASE+4.. the namespace fds, the root, then the
 * ntasks cgroup tasks files of the commands (opened by the edge, as host root: cgroup v1 checks the
 * opener's credentials, so writing a pid there works from inside), it enters the sandbox once (step 2,
 * without joining those cgroups itself: it is not killed with the commands) and keeps only the socket,
 * the tasks files and the host's /proc. */
static const char *serve_enter(int base, int ntasks) {
    if (ntasks < 0 || ntasks > (int)(sizeof serve_tasks / sizeof *serve_tasks)) { errno = EINVAL; return "tasks count"; }
    for (int k = 0; k < ntasks; k++) serve_tasks[k] = base + 12 + k;
    serve_ntasks = ntasks;
    serve_proc_fd = open("/proc", O_PATH | O_DIRECTORY | O_CLOEXEC);
    if (serve_proc_fd < 0) return "/proc";
    const char *stage = enter_sandbox(base + 4, base + 10, base + 11);
    if (stage) return stage;
    for (int fd = base + 4; fd <= base + 11; fd++) close(fd);
    return NULL;
}

static void feed(struct slot *sl) {
    ssize_t w = write(sl->in_fd, sl->in_buf + sl->in_off, sl->in_len - sl->in_off);
    if (w > 0) sl->in_off += (size_t)w;
    if ((w < 0 && errno != EAGAIN && errno != EINTR) || sl->in_off == sl->in_len) {   /* done, or EPIPE */
        close_fd(&sl->in_fd);
        free(sl->in_buf);
        sl->in_buf = NULL;
    }
}

static void drain(int sock, int i, int s) {
    struct slot *sl = running[i];
    ssize_t r = read(sl->out_fd[s], chunk, sizeof chunk);
    if (r > 0) take_output(sock, sl, s, chunk, (size_t)r);
    else if (r == 0 || (errno != EAGAIN && errno != EINTR)) close_fd(&sl->out_fd[s]);
}

static void on_exit_of(int sock, pid_t pid, int status) {
    for (int i = 0; i < SERVE_SLOTS; i++) {
        struct slot *sl = running[i];
        if (!sl || sl->pid != pid) continue;
        if (!sl->collect) {
            answer(sock, sl->id, status);
            free(sl);
            running[i] = NULL;
        } else {
            sl->reaped = 1;
            sl->status = status;
        }
        return;
    }
}

static int serve(int base, int ntasks) {
    const int sock = base + 3;
    if (serve_enter(base, ntasks)) return 2;
    sigset_t chld;
    sigemptyset(&chld);
    sigaddset(&chld, SIGCHLD);
    int sfd = signalfd(-1, &chld, SFD_CLOEXEC | SFD_NONBLOCK);
    if (sfd < 0) return 2;
    static struct pollfd pfd[2 + 3 * SERVE_SLOTS];
    static int who[2 + 3 * SERVE_SLOTS];           /* slot * 4 + (0 stdin, 1 stdout, 2 stderr) */
    for (;;) {
        int np = 2;
        pfd[0] = (struct pollfd){sock, POLLIN, 0};
        pfd[1] = (struct pollfd){sfd, POLLIN, 0};
        for (int i = 0; i < SERVE_SLOTS; i++) {
            struct slot *sl = running[i];
            if (!sl || !sl->collect) continue;
            if (sl->in_fd >= 0) { who[np] = i * 4; pfd[np++] = (struct pollfd){sl->in_fd, POLLOUT, 0}; }
            for (int s = 0; s < 2; s++)
                if (sl->out_fd[s] >= 0) { who[np] = i * 4 + 1 + s; pfd[np++] = (struct pollfd){sl->out_fd[s], POLLIN, 0}; }
        }
        if (poll(pfd, (nfds_t)np, -1) < 0) { if (errno == EINTR) continue; return 2; }
        for (int k = 2; k < np; k++) {
            if (!pfd[k].revents) continue;
            int i = who[k] / 4, what = who[k] % 4;
            if (what == 0) feed(running[i]); else drain(sock, i, what - 1);
        }
        if (pfd[1].revents) {
            struct signalfd_siginfo si;
            while (read(sfd, &si, sizeof si) == sizeof si) {}
            int status;
            for (pid_t pid; (pid = waitpid(-1, &status, WNOHANG)) > 0; ) on_exit_of(sock, pid, status);
        }
        for (int i = 0; i < SERVE_SLOTS; i++) {        /* collects whose command and streams ended */
            struct slot *sl = running[i];
            if (sl && sl->collect && sl->reaped && sl->out_fd[0] < 0 && sl->out_fd[1] < 0) finish(sock, i);
        }
        if (pfd[0].revents) {
            uint64_t id = 0;
            char ctl[CMSG_SPACE(sizeof(int) * SERVE_FDS)];
            struct iovec iov = {request, sizeof request};
            struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl, .msg_controllen = sizeof ctl};
            ssize_t n = recvmsg(sock, &mh, MSG_CMSG_CLOEXEC);
            if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
            if (n <= 0) return 0;                      /* the edge's end closed: the worker is gone */
            int fds[SERVE_FDS], got = 0;
            for (struct cmsghdr *c = CMSG_FIRSTHDR(&mh); c; c = CMSG_NXTHDR(&mh, c))
                if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
                    int k = (int)((c->cmsg_len - CMSG_LEN(0)) / sizeof(int));
                    for (int j = 0; j < k; j++) {
                        int fd;
                        memcpy(&fd, CMSG_DATA(c) + j * sizeof(int), sizeof fd);
                        if (got < SERVE_FDS) fds[got++] = fd; else close(fd);
                    }
                }
            if (n >= 8) memcpy(&id, request, sizeof id);
            uint32_t kind = 0;
            if (n >= 12) memcpy(&kind, request + 8, sizeof kind);
            if (n == sizeof id && got == SERVE_FDS && !(mh.msg_flags & (MSG_CTRUNC | MSG_TRUNC))) {
                start_one(sock, id, fds);
            } else if (n >= COLLECT_HEAD && kind == 1 && got == 0 && !(mh.msg_flags & (MSG_CTRUNC | MSG_TRUNC))) {
                start_collect(sock, id, (size_t)n);
            } else {
                for (int j = 0; j < got; j++) close(fds[j]);
                answer(sock, id, -EINVAL);
            }
        }
    }
}

int main(int argc, char **argv) {
    sigset_t all;
    sigfillset(&all);
    sigprocmask(SIG_BLOCK, &all, &child_mask);   /* the command gets the mask we were spawned with */
    build_filter();
    int fd = open("/proc/sys/kernel/cap_last_cap", O_RDONLY | O_CLOEXEC);
    char text[16] = {0};
    if (fd >= 0 && read(fd, text, sizeof text - 1) > 0 && atoi(text) > 0 && atoi(text) < 63) last_cap = atoi(text);
    if (fd >= 0) close(fd);
    if (argc == 4 && strcmp(argv[1], "--serve") == 0)
        return serve(atoi(argv[2]), atoi(argv[3]));
    if (argc < 4 || strcmp(argv[2], "--") != 0) {
        errno = EINVAL;
        fail("setup", "usage: dsec-enter BASE -- ARGV... (setup on fd BASE+12) | dsec-enter --serve BASE NTASKS");
    }
    enter_and_run(atoi(argv[1]), argv + 3, environ);
}
