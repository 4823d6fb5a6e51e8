/* dsec-enter: put the calling process into a running sandbox, then exec the command.
 *
 * Spawned by the edge with posix_spawn (vfork: no copy of the edge's memory, safe with threads)
 * after the spawning thread pointed its pid_for_children at the sandbox's pid namespace, so this
 * process already lives in it. A Python fork cost ~1.3 ms here; spawning this static helper ~0.4 ms.
 *
 *   dsec-enter BASE CAPMASK CWD CGROUP_TASKS_FILE... -- ARGV...
 *   fds: 0-2 stdio, BASE+3 error pipe (write end), BASE+4..BASE+7 ns fds (ipc uts net mnt),
 *   BASE+8 sandbox root. BASE is above every fd the spawner passes, so its dup2s never clobber a source.
 * The environment is the command's, exactly. On failure it writes "stage\0errno\0message" to the
 * error pipe and exits 127; success closes the error pipe by exec (CLOEXEC).
 *
 * Every exec gets a user namespace of its own (identity-mapped: uid 0 is still uid 0 on files). The
 * kernel lets a process read another's /proc/<pid>/fd, mem or environ, ptrace it or take its fds
 * only from the same user namespace (or with CAP_SYS_PTRACE, which no command has), so a process
 * left behind by an earlier command can neither read nor write a later command's pipes.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/audit.h>
#include <linux/capability.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <stddef.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#define NS_COUNT 4
static int ERR_FD = 2;

static void fail(const char *stage, const char *what) {
    char buf[512];
    int e = errno;
    int n = snprintf(buf, sizeof buf, "%s%c%d%c%s: %s", stage, 0, e, 0, what, strerror(e));
    if (n > 0) (void)!write(ERR_FD, buf, (size_t)n < sizeof buf ? (size_t)n : sizeof buf);
    _exit(127);
}

static void join(const char *tasks) {
    int fd = open(tasks, O_WRONLY | O_CLOEXEC);
    if (fd < 0 || write(fd, "0", 1) != 1) fail("setup", tasks);
    close(fd);
}

static int write_file(const char *path, const char *text) {
    int fd = open(path, O_WRONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    ssize_t n = write(fd, text, strlen(text));
    close(fd);
    return n == (ssize_t)strlen(text) ? 0 : -1;
}

/* Move into a new user namespace, identity-mapped. Its maps can only be written from the parent
 * namespace with CAP_SETUID/CAP_SETGID there, so a child forked before the unshare writes them. */
static void own_userns(void) {
    int sync[2];
    if (pipe2(sync, O_CLOEXEC)) fail("setup", "pipe");
    pid_t helper = fork();
    if (helper < 0) fail("setup", "fork");
    if (helper == 0) {
        char c, path[64];
        close(sync[1]);
        if (read(sync[0], &c, 1) != 1) _exit(1);          /* the parent died before unsharing */
        int parent = (int)getppid();
        snprintf(path, sizeof path, "/proc/%d/uid_map", parent);
        if (write_file(path, "0 0 4294967295")) _exit(2);
        snprintf(path, sizeof path, "/proc/%d/gid_map", parent);
        if (write_file(path, "0 0 4294967295")) _exit(3);
        _exit(0);
    }
    close(sync[0]);
    int unshared = unshare(CLONE_NEWUSER);
    int e = errno;
    (void)!write(sync[1], "u", unshared == 0 ? 1 : 0);
    close(sync[1]);
    int status = 0;
    while (waitpid(helper, &status, 0) < 0 && errno == EINTR) {}
    if (unshared) { errno = e; fail("setup", "unshare user namespace"); }
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) { errno = EPERM; fail("setup", "user namespace map"); }
}

/* Commands may not make user namespaces of their own: each one is charged to the host's uid 0, so a
 * sandbox keeping thousands alive would exhaust user.max_user_namespaces and stop every new exec on
 * the node (each exec needs one). unshare/clone with CLONE_NEWUSER fail with EPERM; clone3, whose
 * flags a filter cannot read, fails with ENOSYS, so libc falls back to clone (as Docker does). */
static void no_new_userns(void) {
    struct sock_filter f[] = {
        /*  0 */ BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, arch)),
        /*  1 */ BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, AUDIT_ARCH_X86_64, 1, 0),
        /*  2 */ BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, AUDIT_ARCH_I386, 7, 15),
        /* x86_64 */
        /*  3 */ BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
        /*  4 */ BPF_JUMP(BPF_JMP | BPF_JGE | BPF_K, 0x40000000, 0, 1),   /* the x32 ABI: refused */
        /*  5 */ BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | ENOSYS),
        /*  6 */ BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, 435 /* clone3 */, 0, 1),
        /*  7 */ BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | ENOSYS),
        /*  8 */ BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, 272 /* unshare */, 6, 0),
        /*  9 */ BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, 56 /* clone */, 5, 8),
        /* i386 */
        /* 10 */ BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
        /* 11 */ BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, 435 /* clone3 */, 0, 1),
        /* 12 */ BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | ENOSYS),
        /* 13 */ BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, 310 /* unshare */, 1, 0),
        /* 14 */ BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, 120 /* clone */, 0, 3),
        /* flags */
        /* 15 */ BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, args[0])),   /* low half */
        /* 16 */ BPF_JUMP(BPF_JMP | BPF_JSET | BPF_K, CLONE_NEWUSER, 0, 1),
        /* 17 */ BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | EPERM),
        /* 18 */ BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
    };
    struct sock_fprog prog = {sizeof f / sizeof f[0], f};
    if (prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog, 0, 0)) fail("setup", "seccomp");
}

static void lockdown(unsigned long long keep) {
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)) fail("setup", "no_new_privs");
    for (int cap = 0; cap <= 63; cap++) {
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
 * being run by the image's /bin/sh, which the sandbox may have replaced. */
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
        if (n > 0 && (size_t)n < sizeof buf) {
            execve(buf, cmd, envp);
            if (errno == EACCES) seen_eacces = 1;
            else if (errno != ENOENT && errno != ENOTDIR) return;     /* e.g. ENOEXEC: report it */
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
    syscall(SYS_keyctl, 1 /* KEYCTL_JOIN_SESSION_KEYRING */, (char *)NULL);   /* none on kernels without keys */
}

int main(int argc, char **argv) {
    if (argc < 6) { errno = EINVAL; fail("setup", "usage: dsec-enter BASE CAPMASK CWD TASKS... -- ARGV..."); }
    int base = atoi(argv[1]);
    ERR_FD = base + 3;
    const int NS_FD0 = base + 4, ROOT_FD = base + 8;
    unsigned long long keep = strtoull(argv[2], NULL, 0);
    const char *cwd = argv[3];
    int i = 4;
    for (; i < argc && strcmp(argv[i], "--") != 0; i++) join(argv[i]);
    if (i + 1 >= argc) { errno = EINVAL; fail("setup", "no command"); }
    for (int k = 0; k < NS_COUNT; k++)
        if (setns(NS_FD0 + k, 0)) fail("setup", "setns");
    own_userns();   /* after the mount namespace (its root is ours: no chroot yet), before chroot */
    if (fchdir(ROOT_FD) || chroot(".")) fail("setup", "chroot");
    if (chdir(cwd)) fail("cwd", cwd);
    clean_slate();
    lockdown(keep);
    no_new_userns();   /* after no_new_privs (lockdown): a filter needs it without CAP_SYS_ADMIN */
    fcntl(ERR_FD, F_SETFD, FD_CLOEXEC);
    if (syscall(SYS_close_range, 3, ERR_FD - 1, 0) || syscall(SYS_close_range, ERR_FD + 1, ~0U, 0)) {
        long max = sysconf(_SC_OPEN_MAX);          /* no close_range (old kernel): close one by one */
        for (long fd = 3; fd < (max > 0 ? max : 65536); fd++)
            if (fd != ERR_FD) close((int)fd);
    }
    char **cmd = argv + i + 1;
    exec_path(cmd, environ);
    fail("exec", cmd[0]);
    return 127;
}
