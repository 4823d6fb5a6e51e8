"""The trusted shell: string commands run with it, never with anything of the sandbox's own.

A static busybox, bind-mounted read-only at /.dsec by the backend: a mount point, so it can be
neither renamed, removed nor written from inside, and without CAP_SYS_ADMIN nothing can be mounted
over it. Being static, it reads no library and ignores LD_PRELOAD.
"""

TRUSTED_DIR = "/.dsec"
TRUSTED_SHELL = "/.dsec/sh"


def command_argv(argv: list[str], shell: str, trusted: str = TRUSTED_SHELL) -> list[str]:
    """What runs for an exec request: the trusted shell (the backend's) for a script, else its argv as given."""
    return [trusted, "-c", shell] if shell else argv
