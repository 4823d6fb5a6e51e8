"""Ids the SDK makes: short, unique, valid as subject tokens."""
import uuid


def new_id(prefix: str) -> str:
    """A short unique id usable as a subject token."""
    return f"{prefix}{uuid.uuid4().hex[:16]}"
