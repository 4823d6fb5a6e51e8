"""The trusted shell: string commands run with it, never with anything of the sandbox's own.

A static shell, bind-mounted read-only at /.dsec by the backend: a mount point, so it can be neither
renamed, removed nor written from inside, and without CAP_SYS_ADMIN nothing can be mounted over it.
Being static, it ignores LD_PRELOAD and loads no library to run (only glibc's NSS modules of the image for
a `~user` or a missing HOME, as any program of the image would). It is Debian's bash-static (run as `sh`: POSIX
mode, no startup file), so the programs a string names are the image's, found on PATH as in the image's
own shell. Beside it, a static busybox (/.dsec/busybox) for the platform's own scripts in a sandbox,
whose applets need nothing of the image; busybox-static's sh was the shell before, and it runs its own
applet for any name it has one of (`ls --version` on a Debian image was busybox's ls).
"""

TRUSTED_DIR = "/.dsec"
TRUSTED_SHELL = "/.dsec/sh"
TRUSTED_BUSYBOX = "/.dsec/busybox"


def command_argv(argv: list[str], shell: str, trusted: str = TRUSTED_SHELL) -> list[str]:
    """What runs for an exec request: the trusted shell (the backend's) for a script, else its argv as given."""
    return [trusted, "-c", shell] if shell else argv
