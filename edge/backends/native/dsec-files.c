/* dsec-files: one file-tree operation inside a VM's guest, run by the agent as an exec (the VM's own
 * kernel is the boundary: paths resolve in the guest root as the sandbox's commands see it; a symlink
 * as the last component is acted on itself, never followed, by stat, list, remove and rename).
 *
 *   files stat PATH                       an entry
 *   files list PATH DEPTH MAX [AFTER]     a page of the entries below PATH, DEPTH levels: the first MAX by
 *                                         path (strcmp: bytes) that sort after AFTER (hex of the bytes), after
 *                                         the next page's AFTER (hex of its last path; "" for the last page)
 *   files mkdir PATH                      "1" made (with missing parents, 0755), "0" it was a directory already
 *   files remove PATH                     a file, a symlink (not what it points to), or a whole tree
 *   files rename SRC DEST                 the entry at DEST
 *   files read PATH OFFSET LENGTH         "SIZE\0" then up to LENGTH bytes from OFFSET (a regular file)
 *   files write PATH OFFSET MODE [KEY HEXVALUE]...   stdin's bytes at OFFSET: 0 creates or truncates it with
 *                                         exactly MODE (octal) and these user.KEY xattrs in place of its
 *                                         old ones; a later piece must start where the file ends (EINVAL)
 *
 * First, optionally: --as UID:GID[:GROUP...]: the operation runs as that user (every permission checked as
 * it, what it makes its own).
 *
 * An entry is NUL-terminated fields: path, type (dir, file, symlink, other), size, mode (octal), uid, gid,
 * mtime (seconds.nanoseconds), symlink target, the number of user.* xattrs, then each one's key and value
 * (hex). On failure: exit status errno, stderr one line. edge/backends/microvm/files.py reads it.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/xattr.h>
#include <unistd.h>

#include "dsec-become.h"

static long max_entries;

static void fail(int err, const char *what, const char *path)
{
    fprintf(stderr, "%s: %s: %s\n", what, path, strerror(err));
    exit(err ? err : 1);
}

static void put(const char *s) { fwrite(s, 1, strlen(s) + 1, stdout); }

static void putf(const char *fmt, long long v)
{
    char buf[64];
    snprintf(buf, sizeof buf, fmt, v);
    put(buf);
}

static void metadata(const char *path)
{
    char names[65536], value[8192], hex[16385];
    ssize_t n = llistxattr(path, names, sizeof names);
    int count = 0;
    for (ssize_t at = 0; n > 0 && at < n; at += strlen(names + at) + 1)
        count += strncmp(names + at, "user.", 5) == 0;
    putf("%lld", count);
    for (ssize_t at = 0; n > 0 && at < n; at += strlen(names + at) + 1) {
        if (strncmp(names + at, "user.", 5) != 0)
            continue;
        ssize_t len = lgetxattr(path, names + at, value, sizeof value);
        if (len < 0)
            len = 0;
        for (ssize_t i = 0; i < len; i++)
            sprintf(hex + 2 * i, "%02x", (unsigned char)value[i]);
        hex[2 * len] = 0;
        put(names + at + 5);
        put(hex);
    }
}

static void entry(const char *path, const struct stat *s)
{
    char target[4096] = "";
    const char *type = S_ISDIR(s->st_mode) ? "dir" : S_ISREG(s->st_mode) ? "file" : S_ISLNK(s->st_mode) ? "symlink"
                                                                                                    : "other";
    if (S_ISLNK(s->st_mode)) {
        ssize_t n = readlink(path, target, sizeof target - 1);
        target[n > 0 ? n : 0] = 0;
    }
    char mtime[64];
    snprintf(mtime, sizeof mtime, "%lld.%09ld", (long long)s->st_mtim.tv_sec, s->st_mtim.tv_nsec);
    put(path);
    put(type);
    putf("%lld", s->st_size);
    putf("%llo", s->st_mode & 07777);
    putf("%lld", s->st_uid);
    putf("%lld", s->st_gid);
    put(mtime);
    put(target);
    if (S_ISREG(s->st_mode) || S_ISDIR(s->st_mode))
        metadata(path);
    else
        put("0");
}

/* A listing's page: the walk keeps the paths that sort after `after` (names only, no stat), cut back to the
 * smallest max_entries + 1 whenever the list doubles past that; then the first max_entries are looked at. */
static char **found;
static size_t nfound, room;
static const char *after = "";
static long scanned;   /* names a page's walk read: past MAX_SCAN the listing is refused (EFBIG) */
#define MAX_SCAN 1000000L

static char *cursor_of(const char *hex)   /* a cursor's bytes (NULL for bad hex) */
{
    size_t n = strlen(hex);
    char *out = malloc(n / 2 + 1);
    if (!out || n % 2)
        return NULL;
    for (size_t i = 0; i < n / 2; i++) {
        unsigned v;
        if (sscanf(hex + 2 * i, "%2x", &v) != 1)
            return NULL;
        out[i] = (char)v;
    }
    out[n / 2] = 0;
    return memchr(out, 0, n / 2) ? NULL : out;
}

static void put_hex(const char *s)
{
    size_t n = strlen(s);
    char *hex = malloc(2 * n + 1);
    if (!hex)
        fail(ENOMEM, "list", s);
    for (size_t i = 0; i < n; i++)
        sprintf(hex + 2 * i, "%02x", (unsigned char)s[i]);
    hex[2 * n] = 0;
    put(hex);
    free(hex);
}

static int by_path(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

static void keep_smallest(size_t n)
{
    qsort(found, nfound, sizeof *found, by_path);
    while (nfound > n)
        free(found[--nfound]);
}

static void keep(const char *path)
{
    if (nfound == room) {
        if (room >= 2 * (size_t)max_entries + 2) {
            keep_smallest(max_entries + 1);
        } else {
            room = room ? 2 * room : 1024;
            if (!(found = realloc(found, room * sizeof *found)))
                fail(ENOMEM, "list", path);
        }
    }
    if (!(found[nfound++] = strdup(path)))
        fail(ENOMEM, "list", path);
}

static void walk(const char *path, int depth, dev_t dev)
{
    DIR *d = opendir(path);
    if (!d)
        return;   /* unreadable: its entries are not listed (as from the edge) */
    struct dirent *de;
    while ((de = readdir(d))) {
        if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, ".."))
            continue;
        char sub[8192];
        snprintf(sub, sizeof sub, "%s/%s", strcmp(path, "/") ? path : "", de->d_name);
        if (++scanned > MAX_SCAN)
            fail(EFBIG, "list", path);
        if (strcmp(sub, after) > 0)
            keep(sub);
        if (depth <= 1 || (de->d_type != DT_DIR && de->d_type != DT_UNKNOWN))
            continue;
        char below[sizeof sub + 1];   /* every path under it starts so: all before `after`, or not one */
        snprintf(below, sizeof below, "%s/", sub);
        if (strcmp(after, below) > 0 && strncmp(after, below, strlen(below)) != 0)
            continue;
        struct stat s;
        if (lstat(sub, &s) == 0 && S_ISDIR(s.st_mode) && s.st_dev == dev)   /* (an overlay's files may show
                                                                             their layer's st_dev; its dirs its own) */
            walk(sub, depth - 1, dev);
    }
    closedir(d);
}

static void listing(void)
{
    keep_smallest(max_entries + 1);   /* (the one past them tells that more follow) */
    if (nfound > (size_t)max_entries)
        put_hex(found[max_entries - 1]);
    else
        put("");
    for (size_t i = 0; i < nfound && i < (size_t)max_entries; i++) {
        struct stat s;
        if (lstat(found[i], &s) == 0)   /* (gone meanwhile: left out) */
            entry(found[i], &s);
    }
}

static int rm_one(const char *path, const struct stat *s, int flag, struct FTW *ftw)
{
    (void)s; (void)ftw;
    if ((flag == FTW_DP ? rmdir(path) : unlink(path)) < 0 && errno != ENOENT)
        fail(errno, "remove", path);
    return 0;
}

static int make_dirs(const char *path)
{
    char buf[8192];
    int made = 0;
    snprintf(buf, sizeof buf, "%s", path);
    for (char *p = buf + 1; ; p++) {
        if (*p == '/' || *p == 0) {
            char c = *p;
            *p = 0;
            if (mkdir(buf, 0755) == 0)
                made = 1;
            else if (errno == EEXIST)
                made = 0;
            else
                fail(errno, "mkdir", buf);
            *p = c;
            if (!c)
                break;
        }
    }
    struct stat s;
    if (stat(path, &s) < 0)
        fail(errno, "mkdir", path);
    if (!S_ISDIR(s.st_mode))
        fail(ENOTDIR, "mkdir", path);
    return made;
}

static int unhex(int c) { return c <= '9' ? c - '0' : (c | 32) - 'a' + 10; }

static void write_at(const char *path, long long offset, int mode, int argc, char **kv)
{
    int fd = open(path, O_WRONLY | O_CLOEXEC | (offset ? 0 : O_CREAT | O_TRUNC), mode);
    if (fd < 0)
        fail(errno, "write", path);
    struct stat s;
    if (fstat(fd, &s) < 0)
        fail(errno, "write", path);
    if (!S_ISREG(s.st_mode))
        fail(ENXIO, "write", path);
    if (offset == 0) {
        if (fchmod(fd, mode) < 0)
            fail(errno, "write", path);
        char names[65536];
        ssize_t n = flistxattr(fd, names, sizeof names);
        for (ssize_t at = 0; n > 0 && at < n; at += strlen(names + at) + 1) {
            int keep = 0;
            for (int i = 0; i + 1 < argc; i += 2)
                keep |= !strncmp(names + at, "user.", 5) && !strcmp(names + at + 5, kv[i]);
            if (!strncmp(names + at, "user.", 5) && !keep)
                fremovexattr(fd, names + at);
        }
        for (int i = 0; i + 1 < argc; i += 2) {
            char name[300], value[8192];
            size_t len = strlen(kv[i + 1]) / 2;
            for (size_t j = 0; j < len && j < sizeof value; j++)
                value[j] = (char)(unhex(kv[i + 1][2 * j]) << 4 | unhex(kv[i + 1][2 * j + 1]));
            snprintf(name, sizeof name, "user.%s", kv[i]);
            if (fsetxattr(fd, name, value, len, 0) < 0)
                fail(errno, "write", path);
        }
    } else if (s.st_size != offset) {
        fprintf(stderr, "the file holds %lld bytes, not %lld: a piece was lost\n", (long long)s.st_size, offset);
        exit(EINVAL);
    }
    char buf[65536];
    ssize_t n;
    off_t at = offset;
    while ((n = read(0, buf, sizeof buf)) > 0)
        for (ssize_t done = 0; done < n; ) {
            ssize_t w = pwrite(fd, buf + done, n - done, at);
            if (w < 0)
                fail(errno, "write", path);
            done += w;
            at += w;
        }
    if (n < 0 || close(fd) < 0)
        fail(errno, "write", path);
}

static void read_at(const char *path, long long offset, long long length)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    struct stat s;
    if (fd < 0 || fstat(fd, &s) < 0)
        fail(errno, "read", path);
    if (!S_ISREG(s.st_mode))
        fail(ENXIO, "read", path);
    putf("%lld", s.st_size);
    char buf[65536];
    while (length > 0) {
        ssize_t n = pread(fd, buf, length < (long long)sizeof buf ? length : (long long)sizeof buf, offset);
        if (n < 0)
            fail(errno, "read", path);
        if (n == 0)
            break;
        fwrite(buf, 1, n, stdout);
        offset += n;
        length -= n;
    }
}

int main(int argc, char **argv)
{
    struct stat s;
    if (argc > 3 && !strcmp(argv[1], "--as")) {
        if (become(argv[2]))
            fail(errno, "user", argv[2]);
        argc -= 2;
        argv += 2;
    }
    if (argc < 3) {
        fprintf(stderr, "usage: files stat|list|mkdir|remove|rename|read|write PATH ...\n");
        return EINVAL;
    }
    const char *op = argv[1], *path = argv[2];
    if (!strcmp(op, "stat")) {
        if (lstat(path, &s) < 0)
            fail(errno, "stat", path);
        entry(path, &s);
    } else if (!strcmp(op, "list") && (argc == 5 || argc == 6)) {
        if (stat(path, &s) < 0)
            fail(errno, "list", path);
        if (!S_ISDIR(s.st_mode))
            fail(ENOTDIR, "list", path);
        max_entries = atol(argv[4]);
        if (max_entries < 1)
            fail(EINVAL, "list", path);
        if (argc == 6 && !(after = cursor_of(argv[5])))
            fail(EINVAL, "list", path);
        walk(path, atoi(argv[3]), s.st_dev);
        listing();
    } else if (!strcmp(op, "mkdir")) {
        put(make_dirs(path) ? "1" : "0");
    } else if (!strcmp(op, "remove")) {
        if (lstat(path, &s) < 0)
            fail(errno, "remove", path);
        if (!S_ISDIR(s.st_mode)) {
            if (unlink(path) < 0)
                fail(errno, "remove", path);
        } else if (nftw(path, rm_one, 64, FTW_DEPTH | FTW_PHYS) != 0) {
            fail(errno, "remove", path);
        }
    } else if (!strcmp(op, "rename") && argc == 4) {
        if (rename(path, argv[3]) < 0)
            fail(errno, "rename", path);
        if (lstat(argv[3], &s) < 0)
            fail(errno, "rename", argv[3]);
        entry(argv[3], &s);
    } else if (!strcmp(op, "read") && argc == 5) {
        read_at(path, atoll(argv[3]), atoll(argv[4]));
    } else if (!strcmp(op, "write") && argc >= 5 && argc % 2 == 1) {
        write_at(path, atoll(argv[3]), (int)strtol(argv[4], NULL, 8) & 07777, argc - 5, argv + 5);
    } else {
        fprintf(stderr, "files: unknown operation or arguments: %s\n", op);
        return EINVAL;
    }
    return fflush(stdout) == 0 ? 0 : EIO;
}
