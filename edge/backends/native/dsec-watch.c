/* dsec-watch: a directory watch inside a VM's guest (files.watch), run by the agent as an exec; the
 * guest-side twin of edge/backends/watcher.py, with the same output.
 *
 *   watch PATH RECURSIVE(0|1)
 *
 * Prints "ready\n" once PATH (and, recursive, every directory below it, never through a symlink) is
 * watched, then one JSON line per change: {"type":"create"|"write"|"remove"|"rename"|"chmod","name":REL}
 * (REL relative to PATH; "" for PATH itself, after which it ends), {"type":"overflow"} when events were
 * lost. A directory made or moved in is watched too; what it holds by then is reported as created (and
 * the one create inotify may still queue for such an entry is dropped). One moved within the tree is named
 * by its new path from its move on; one moved out is followed no more. Each line on stdin comes back as
 * {"type":"mark","name":LINE} after every event queued when it came. Fails with exit status errno.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/inotify.h>
#include <sys/stat.h>
#include <unistd.h>

#define MAX_DIRS 4096
#define MASK (IN_MODIFY | IN_ATTRIB | IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE | IN_DELETE | IN_DELETE_SELF \
              | IN_MOVE_SELF | IN_ONLYDIR | IN_EXCL_UNLINK)

static int ifd, recursive;
static char *base;
static char *dirs[MAX_DIRS + 1];     /* wd -> path relative to base (NULL: not watched); wds start at 1 */
static int ndirs;
static char **seen;                  /* entries reported as found in a new directory since the last drain */
static int nseen, capseen;

static void emit(const char *type, const char *name)
{
    putchar('{');
    printf("\"type\":\"%s\",\"name\":\"", type);
    for (const unsigned char *p = (const unsigned char *)name; *p; p++) {
        if (*p == '"' || *p == '\\')
            printf("\\%c", *p);
        else if (*p < 0x20)
            printf("\\u%04x", *p);
        else
            putchar(*p);
    }
    fputs("\"}\n", stdout);
}

static char *join(const char *a, const char *b)
{
    char *out;
    if (asprintf(&out, "%s%s%s", a, *a && *b ? "/" : "", b) < 0)
        exit(ENOMEM);
    return out;
}

static int add(const char *rel)
{
    char *full = join(base, rel);
    int wd = inotify_add_watch(ifd, full, MASK | (*rel ? IN_DONT_FOLLOW : 0));   /* PATH itself may be a link */
    int err = errno;
    free(full);
    if (wd < 0)
        return -err;
    if (wd > MAX_DIRS || (!dirs[wd] && ndirs >= MAX_DIRS)) {
        inotify_rm_watch(ifd, wd);
        return -ENOSPC;
    }
    if (!dirs[wd])
        ndirs++;
    free(dirs[wd]);
    dirs[wd] = strdup(rel);
    return wd;
}

static void remember(const char *rel)
{
    if (nseen == capseen) {
        capseen = capseen ? 2 * capseen : 64;
        seen = realloc(seen, capseen * sizeof *seen);
    }
    seen[nseen++] = strdup(rel);
}

/* Watch rel and, recursive, the directories below it (a stack of paths: any depth, no recursion); with
 * found, report every entry below as created (listed after its directory's watch is in place). */
static int add_tree(const char *rel, int found)
{
    int wd = add(rel);
    if (wd < 0 || !recursive)
        return wd;
    char **todo = malloc(sizeof *todo);
    int n = 0, cap = 1;
    todo[n++] = strdup(rel);
    while (n) {
        char *at = todo[--n];
        char *full = join(base, at);
        DIR *d = opendir(full);
        struct dirent *de;
        while (d && (de = readdir(d))) {
            if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, ".."))
                continue;
            char *sub = join(at, de->d_name);
            if (found) {
                emit("create", sub);
                remember(sub);
            }
            struct stat s;
            char *subfull = join(base, sub);
            int isdir = lstat(subfull, &s) == 0 && S_ISDIR(s.st_mode);   /* never through a symlink */
            free(subfull);
            if (isdir && ndirs < MAX_DIRS && add(sub) > 0) {
                if (n == cap)
                    todo = realloc(todo, (cap *= 2) * sizeof *todo);
                todo[n++] = sub;
            } else {
                free(sub);
            }
        }
        if (d)
            closedir(d);
        free(full);
        free(at);
    }
    free(todo);
    return wd;
}

static int under(const char *rel, const char *dir)
{
    size_t n = strlen(dir);
    return !strncmp(rel, dir, n) && (!rel[n] || rel[n] == '/');
}

/* A directory moved within the tree (old -> new): what is followed of it takes its new name, by its path
 * alone (it may have moved on already: its later events are named by the move that comes next). 0 when
 * nothing of it was followed yet. */
static int renamed(const char *old, const char *new)
{
    int found = 0;
    for (int wd = 1; wd <= MAX_DIRS; wd++)
        if (dirs[wd] && *dirs[wd] && under(dirs[wd], old)) {
            char *name = join(new, dirs[wd] + strlen(old) + (dirs[wd][strlen(old)] == '/'));
            free(dirs[wd]);
            dirs[wd] = name;
            found = 1;
        }
    return found;
}

/* A directory moved out of the tree: nothing in it is reported any more. */
static void forget(const char *dir)
{
    for (int wd = 1; wd <= MAX_DIRS; wd++)
        if (dirs[wd] && *dirs[wd] && under(dirs[wd], dir)) {
            inotify_rm_watch(ifd, wd);
            free(dirs[wd]);
            dirs[wd] = NULL;
            ndirs--;
        }
}

static uint32_t leaving_cookie;
static char *leaving;   /* the path of a directory moved away, until its arrival (queued right after it) */

static int was_seen(const char *rel)
{
    for (int i = 0; i < nseen; i++)
        if (seen[i] && !strcmp(seen[i], rel)) {
            free(seen[i]);
            seen[i] = NULL;
            return 1;
        }
    return 0;
}

/* Hand out every event queued now; 0 once the watched directory itself is gone. */
static int drain(void)
{
    char buf[65536] __attribute__((aligned(__alignof__(struct inotify_event))));
    ssize_t len;
    while ((len = read(ifd, buf, sizeof buf)) > 0) {
        for (char *p = buf; p < buf + len; ) {
            struct inotify_event *ev = (struct inotify_event *)p;
            p += sizeof *ev + ev->len;
            if (leaving && !((ev->mask & IN_MOVED_TO) && ev->cookie == leaving_cookie)) {
                forget(leaving);
                free(leaving);
                leaving = NULL;
            }
            if (ev->mask & IN_Q_OVERFLOW) {
                emit("overflow", "");
                continue;
            }
            if (ev->wd <= 0 || ev->wd > MAX_DIRS || !dirs[ev->wd])
                continue;
            const char *rel = dirs[ev->wd];
            if (ev->mask & IN_IGNORED) {
                free(dirs[ev->wd]);
                dirs[ev->wd] = NULL;
                ndirs--;
                if (!ndirs)
                    return 0;
                continue;
            }
            if (ev->mask & (IN_DELETE_SELF | IN_MOVE_SELF)) {
                if (!*rel) {
                    emit(ev->mask & IN_DELETE_SELF ? "remove" : "rename", "");
                    return 0;
                }
                continue;
            }
            if (!ev->len || !ev->name[0])
                continue;
            char *path = join(rel, ev->name);
            int skip = was_seen(path) && (ev->mask & (IN_CREATE | IN_MOVED_TO));
            const char *type = ev->mask & (IN_CREATE | IN_MOVED_TO) ? "create" : ev->mask & IN_MODIFY ? "write"
                             : ev->mask & IN_DELETE ? "remove" : ev->mask & IN_MOVED_FROM ? "rename"
                             : ev->mask & IN_ATTRIB ? "chmod" : NULL;
            if (!skip && type)
                emit(type, path);
            if (recursive && (ev->mask & IN_ISDIR) && (ev->mask & IN_MOVED_FROM)) {
                leaving_cookie = ev->cookie;
                leaving = strdup(path);
            } else if (recursive && (ev->mask & IN_ISDIR) && (ev->mask & IN_MOVED_TO) && leaving
                       && renamed(leaving, path)) {
                free(leaving);
                leaving = NULL;
            } else if (!skip && recursive && (ev->mask & IN_ISDIR) && (ev->mask & (IN_CREATE | IN_MOVED_TO))) {
                free(leaving);
                leaving = NULL;
                add_tree(path, 1);
            }
            free(path);
        }
    }
    for (int i = 0; i < nseen; i++)
        free(seen[i]);
    nseen = 0;   /* any create queued before a new directory's listing has been read by now */
    return 1;
}

int main(int argc, char **argv)
{
    if (argc != 3) {
        fprintf(stderr, "usage: watch PATH RECURSIVE\n");
        return EINVAL;
    }
    base = argv[1];
    recursive = atoi(argv[2]);
    setvbuf(stdout, NULL, _IOFBF, 1 << 16);
    ifd = inotify_init1(IN_NONBLOCK | IN_CLOEXEC);
    if (ifd < 0)
        return errno;
    int wd = add_tree("", 0);
    if (wd < 0) {
        fprintf(stderr, "watch: %s: %s\n", base, strerror(-wd));
        return -wd;
    }
    fputs("ready\n", stdout);
    fflush(stdout);
    char line[256];
    size_t have = 0;
    struct pollfd fds[2] = {{ifd, POLLIN, 0}, {0, POLLIN, 0}};
    for (;;) {
        if (poll(fds, fds[1].fd < 0 ? 1 : 2, -1) < 0 && errno != EINTR)
            return errno;
        if (!drain())
            break;
        if (fds[1].fd >= 0 && fds[1].revents) {
            ssize_t n = read(0, line + have, sizeof line - 1 - have);
            if (n <= 0) {
                fds[1].fd = -1;   /* stdin closed: no more marks */
            } else {
                have += n;
                char *nl;
                while ((nl = memchr(line, '\n', have))) {
                    *nl = 0;
                    if (!drain()) {
                        fflush(stdout);
                        return 0;
                    }
                    char name[65];   /* as the edge's watcher: a mark's name is at most 64 bytes */
                    size_t len = strnlen(line, 64);
                    memcpy(name, line, len);
                    name[len] = 0;
                    emit("mark", name);
                    have -= nl + 1 - line;
                    memmove(line, nl + 1, have);
                }
                if (have == sizeof line - 1)
                    have = 0;   /* a mark name longer than any flush sends: dropped */
            }
        }
        fflush(stdout);
    }
    fflush(stdout);
    return 0;
}
