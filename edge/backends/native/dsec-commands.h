/* dsec-commands.h: gVisor's commands, apart from the agent (included by dsec-agent.c, after exec_child;
 * part of the trusted device's digest and of the gVisor agent's build: native/__init__.py GUEST_HEADERS).
 *
 * runsc (2022) lets a root command open /proc/N/fd/F of any process it sees, whatever that process's
 * dumpability (Linux asks that the opener may trace it). So no process a command can see may hold, even for
 * an instant, a file the commands must not have: the agent's channel to the edge (stdin, stdout), its log,
 * its /proc (which shows the agent) or the pids hierarchy that holds their limit. A child the agent forked
 * held all of them between its fork and its first close (helper-45's scanner of /proc/N/fd caught them
 * there while execs started: a forged exit, a stolen request, a raised pids.max).
 *
 * So the agent forks no command. At start it forks the spawner, which sheds every fd but its socket to the
 * agent and then makes the commands' pid namespace, whose pid 1 (commands_init_main) only reaps. The spawner
 * is in the agent's pid namespace (no command sees it); each command is its child in the commands' one,
 * born holding only the spawner's socket (runsc cannot open a socket by /proc: ENXIO) and its own exec's
 * pipes, which the agent sent with the request (SCM_RIGHTS). The spawner reports each fork's pid (in the
 * agent's pid namespace: what the agent signals and reads in its /proc) and each exit.
 *   agent -> spawner: u32 length, then an 'E' request's payload; its fds: stdin, stdout, stderr, report
 *                     [, a terminal's master]
 *   spawner -> agent: struct spawned, 'I' (the commands' init: its pid), 'P' (forked: pid, or -errno),
 *                     'X' (exited: pid, wait status, rusage)
 * Each exec's pids group: the agent moves the spawner into it for the fork (the command is born there) and
 * back out at once (or ends: a kill of that exec's group would take the spawner), so nothing of the
 * hierarchy is ever held where a command can see it. The spawner and the init are in no limit's group. */
#ifndef DSEC_COMMANDS_H
#define DSEC_COMMANDS_H
#include <sys/socket.h>

struct spawned { char kind; int32_t pid, status; struct rusage ru; };

static int spawn_sock = -1;     /* the agent's end of its socket to the spawner; -1: none (a VM) */
static pid_t spawner;           /* its pid */

/* stdin, stdout (and stderr unless `log`) become /dev/null; every other fd but `keep` is closed, by its
 * list (runsc has no close_range). 0, or -1. */
static int shed_fds(int keep, int log) {
    int null = open("/dev/null", O_RDWR | O_CLOEXEC);
    if (null < 0 || dup2(null, 0) < 0 || dup2(null, 1) < 0 || (!log && dup2(null, 2) < 0)) return -1;
    int fds[4096], n = 0;
    DIR *d = opendir("/proc/self/fd");
    if (!d) return -1;
    struct dirent *de;
    while ((de = readdir(d)) && n < 4096) {
        int fd = atoi(de->d_name);
        if (fd > 2 && fd != keep && fd != dirfd(d)) fds[n++] = fd;
    }
    closedir(d);
    for (int i = 0; i < n; i++) close(fds[i]);
    return 0;
}

/* SIGCHLD blocked but where `none` (empty) is waited with: it wakes that wait (EINTR) and no other call. */
static void wake_on_sigchld(sigset_t *none) {
    sigset_t chld;
    struct sigaction sa = {0};
    sa.sa_handler = on_wake; sa.sa_flags = SA_NOCLDSTOP;
    sigaction(SIGCHLD, &sa, NULL);
    sigemptyset(none); sigemptyset(&chld); sigaddset(&chld, SIGCHLD);
    sigprocmask(SIG_SETMASK, &chld, NULL);
}

/* Pid 1 of the commands' pid namespace, under a /proc of its own (the old one detached: the agent keeps it,
 * to find an exec's processes). It only reaps (an orphan of a command is its child): no capability, not
 * dumpable, no fd (the one process of the platform's that commands see). EOF on `rep`: ready. */
static void commands_init_main(int rep) {
    sigset_t none;
    wake_on_sigchld(&none);
    if (umount2("/proc", MNT_DETACH) || mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL))
        fail_child(rep, "the commands' /proc");
    if (shed_fds(rep, 0)) fail_child(rep, "fds");
    prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);
    for (int cap = 0; cap < 64; cap++) prctl(PR_CAPBSET_DROP, cap, 0, 0, 0);
    struct __user_cap_header_struct hdr = {_LINUX_CAPABILITY_VERSION_3, 0};
    struct __user_cap_data_struct no_caps[2] = {{0, 0, 0}, {0, 0, 0}};
    if (syscall(SYS_capset, &hdr, no_caps)) fail_child(rep, "capabilities");
    close(rep);
    for (;;) {
        while (waitpid(-1, NULL, WNOHANG) > 0) {}
        sigsuspend(&none);
    }
}

static void tell_agent(int sock, char kind, pid_t pid, int status, const struct rusage *ru) {
    struct spawned m;
    memset(&m, 0, sizeof m);
    m.kind = kind; m.pid = pid; m.status = status;
    if (ru) m.ru = *ru;
    for (size_t off = 0; off < sizeof m; ) {
        ssize_t w = send(sock, (char *)&m + off, sizeof m - off, MSG_NOSIGNAL);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) _exit(0);                   /* the agent is gone: so is the sandbox */
        off += (size_t)w;
    }
}

static int read_full(int fd, void *buf, size_t n) {
    for (size_t off = 0; off < n; ) {
        ssize_t r = read(fd, (char *)buf + off, n - off);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) return -1;
        off += (size_t)r;
    }
    return 0;
}

/* One request: read it with its fds, fork its command, tell the agent the pid, forget the request (its
 * bytes are zeroed: the next command's copy of the spawner's memory holds no other exec's environment). */
static void spawn_one(int sock) {
    static char *req; static size_t cap;
    uint32_t len;
    int fds[5];
    char cbuf[CMSG_SPACE(sizeof fds)];
    struct iovec iov = { &len, sizeof len };
    struct msghdr mh = { .msg_iov = &iov, .msg_iovlen = 1, .msg_control = cbuf, .msg_controllen = sizeof cbuf };
    ssize_t r;
    while ((r = recvmsg(sock, &mh, MSG_CMSG_CLOEXEC | MSG_WAITALL)) < 0 && errno == EINTR) {}
    if (r != (ssize_t)sizeof len) _exit(0);     /* the agent is gone */
    int nfd = 0;
    for (struct cmsghdr *cm = CMSG_FIRSTHDR(&mh); cm; cm = CMSG_NXTHDR(&mh, cm))
        if (cm->cmsg_level == SOL_SOCKET && cm->cmsg_type == SCM_RIGHTS) {
            nfd = (int)((cm->cmsg_len - CMSG_LEN(0)) / sizeof(int));
            memcpy(fds, CMSG_DATA(cm), (size_t)nfd * sizeof(int));
        }
    if (len > cap) {
        char *grown = malloc(len);
        if (!grown) _exit(111);
        if (req) { memset(req, 0, cap); free(req); }
        req = grown; cap = len;
    }
    if (read_full(sock, req, len)) _exit(0);
    struct child c = { .master = nfd == 5 ? fds[4] : -1, .report_pid = 1 };
    const char *size;
    int end;
    pid_t pid = -EPROTO;
    if (nfd >= 4 && !parse_exec(req, len, &c, &size, &end)) {
        c.in = fds[0]; c.out = fds[1]; c.err = fds[2]; c.rep = fds[3];
        pid = fork();
        if (pid == 0) _exit(exec_child(&c));
        if (pid < 0) pid = -errno;
        free(c.argv);
    }
    for (int i = 0; i < nfd; i++) close(fds[i]);
    memset(req, 0, len);
    tell_agent(sock, 'P', pid, 0, NULL);
}

/* The spawner (see the top): it keeps only its socket (and its log until the commands' init is up). */
static void spawner_main(int sock) {
    sigset_t none;
    wake_on_sigchld(&none);
    if (shed_fds(sock, 1)) die("the spawner's fds");
    int rep[2];
    if (unshare(CLONE_NEWPID)) die("unshare a pid namespace for the commands");
    if (pipe2(rep, O_CLOEXEC)) die("pipe");
    pid_t init = fork();
    if (init < 0) die("fork the commands' init");
    if (init == 0) { close(sock); close(rep[0]); commands_init_main(rep[1]); }
    close(rep[1]);
    char msg[512]; ssize_t k;
    while ((k = read(rep[0], msg, sizeof msg - 1)) < 0 && errno == EINTR) {}
    close(rep[0]);
    if (k > 0) {
        msg[k] = 0;
        const char *text = msg + strlen(msg) + 1;
        text += strlen(text) + 1;
        fprintf(stderr, "dsec-agent: the commands' pid namespace: %s: %s\n", msg, text < msg + k ? text : "");
        _exit(111);
    }
    int null = open("/dev/null", O_WRONLY | O_CLOEXEC);     /* its log too, now (by hand: /proc is the */
    if (null < 0 || dup2(null, 2) < 0) _exit(111);          /* commands' already, without it) */
    close(null);
    tell_agent(sock, 'I', init, 0, NULL);
    for (;;) {
        struct pollfd pf = { .fd = sock, .events = POLLIN };
        int n = ppoll(&pf, 1, NULL, &none);     /* SIGCHLD only here: EINTR */
        int status; struct rusage ru; pid_t pid;
        while ((pid = wait4(-1, &status, WNOHANG, &ru)) > 0) {
            if (pid == init) _exit(0);          /* no command can run any more: the agent sees us end */
            tell_agent(sock, 'X', pid, status, &ru);
        }
        if (n > 0 && pf.revents) spawn_one(sock);
    }
}

/* The agent: fork the spawner and learn its commands' init. */
static void start_commands(void) {
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv)) die("socketpair");
    pid_t pid = fork();
    if (pid < 0) die("fork the spawner");
    if (pid == 0) { close(sv[0]); spawner_main(sv[1]); }
    close(sv[1]);
    struct spawned m;
    if (read_full(sv[0], &m, sizeof m) || m.kind != 'I') {
        fprintf(stderr, "dsec-agent: the commands' pid namespace did not start\n");
        _exit(111);
    }
    spawn_sock = sv[0];
    spawner = pid;
    commands_init = m.pid;
}

static void exited(pid_t pid, int status, const struct rusage *ru);
static char sbuf[64 * sizeof(struct spawned)];
static size_t slen;

/* What the spawner sent: its exits are acted on, up to and including a 'P' if `until_p` (the pid of a fork
 * just asked for, which must be known before the exits after it). Reads (waiting) only when `wait`; the pid,
 * or 0 if no 'P' came. */
static int32_t from_spawner(int wait, int until_p) {
    for (;;) {
        size_t off = 0;
        int32_t got = 0;
        int have = 0;
        while (slen - off >= sizeof(struct spawned) && !have) {
            struct spawned m;
            memcpy(&m, sbuf + off, sizeof m);
            off += sizeof m;
            if (m.kind == 'X') exited(m.pid, m.status, &m.ru);
            else if (m.kind == 'P' && until_p) { got = m.pid; have = 1; }
        }
        memmove(sbuf, sbuf + off, slen - off);
        slen -= off;
        if (have || !wait) return got;
        ssize_t r = read(spawn_sock, sbuf + slen, sizeof sbuf - slen);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) {
            fprintf(stderr, "dsec-agent: the spawner of the commands ended\n");
            exit(0);
        }
        slen += (size_t)r;
        if (!until_p) wait = 0;                 /* (the poll loop: what one read brought) */
    }
}

/* Write text to dirfd/path: 0, or -1 with errno. */
static int fd_write_all(int dirfd, const char *path, const char *text) {
    int fd = openat(dirfd, path, O_WRONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    ssize_t n = (ssize_t)strlen(text);
    int ok = write(fd, text, (size_t)n) == n;
    int e = errno;
    close(fd);
    errno = e;
    return ok ? 0 : -1;
}

/* An exec's command, forked by the spawner, born in the exec's pids group `join` (under pidsfd). */
static pid_t spawn_command(const char *p, size_t n, const struct child *c, const char *join) {
    char me[16];
    snprintf(me, sizeof me, "%d", spawner);
    if (c->groups_ok && fd_write_all(pidsfd, join, me)) return -1;
    uint32_t len = (uint32_t)n;
    int fds[5] = { c->in, c->out, c->err, c->rep, c->master };
    int nfd = c->master >= 0 ? 5 : 4;
    char cbuf[CMSG_SPACE(sizeof fds)];
    memset(cbuf, 0, sizeof cbuf);
    struct iovec iov[2] = { { &len, sizeof len }, { (void *)p, n } };
    struct msghdr mh = { .msg_iov = iov, .msg_iovlen = 2, .msg_control = cbuf,
                         .msg_controllen = CMSG_SPACE((size_t)nfd * sizeof(int)) };
    struct cmsghdr *cm = CMSG_FIRSTHDR(&mh);
    cm->cmsg_level = SOL_SOCKET; cm->cmsg_type = SCM_RIGHTS; cm->cmsg_len = CMSG_LEN((size_t)nfd * sizeof(int));
    memcpy(CMSG_DATA(cm), fds, (size_t)nfd * sizeof(int));
    size_t total = sizeof len + n, sent = 0;
    while (sent < total) {                      /* the fds go with the first bytes; a long request's rest */
        ssize_t w;                              /* follows without them */
        if (sent == 0) w = sendmsg(spawn_sock, &mh, MSG_NOSIGNAL);
        else if (sent < sizeof len) w = send(spawn_sock, (char *)&len + sent, sizeof len - sent, MSG_NOSIGNAL);
        else w = send(spawn_sock, p + (sent - sizeof len), total - sent, MSG_NOSIGNAL);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) die("send to the spawner");
        sent += (size_t)w;
    }
    int32_t pid = from_spawner(1, 1);
    /* The spawner leaves the group for the root one, where it started: only the command is in it. */
    if (c->groups_ok && fd_write_all(pidsfd, "cgroup.procs", me)) die("the spawner's pids group");
    if (pid <= 0) { errno = pid < 0 ? -pid : EPROTO; return -1; }
    return pid;
}

#endif
