/* dsec-become.h: become a sandbox user, for the guest agent's execs (dsec-agent.c) and the guest's file
 * helper (dsec-files.c). Included by both; part of the trusted device's digest (microvm/guest.py). */
#ifndef DSEC_BECOME_H
#define DSEC_BECOME_H
#include <errno.h>
#include <grp.h>
#include <stdlib.h>
#include <unistd.h>

/* Become "UID:GID[:GROUP...]" (the groups in full, as initgroups would have them): 0 on success. */
static inline int become(const char *user) {
    gid_t groups[64];
    unsigned long v[66];
    int n = 0;
    for (const char *s = user; *s && n < 66; n++) {
        char *end;
        v[n] = strtoul(s, &end, 10);
        if (end == s || v[n] > 65535 || (*end && *end != ':')) { errno = EINVAL; return -1; }
        s = *end ? end + 1 : end;
    }
    if (n < 2) { errno = EINVAL; return -1; }
    for (int i = 2; i < n; i++) groups[i - 2] = (gid_t)v[i];
    if (setgroups((size_t)(n - 2), groups) || setresgid((gid_t)v[1], (gid_t)v[1], (gid_t)v[1])
        || setresuid((uid_t)v[0], (uid_t)v[0], (uid_t)v[0])) return -1;
    return 0;
}

#endif
