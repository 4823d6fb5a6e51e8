"""The microvm accelerator choice (unit: no QEMU): KVM only where a guest booted under it, the probe
paid once per host key, a forced choice the host cannot give refused."""
from __future__ import annotations

import json

import pytest

from edge.backends.microvm import accel


@pytest.mark.parametrize("requested,has_kvm,boots,expected", [
    ("auto", False, None, "tcg"),      # no device: no probe, tcg
    ("auto", True, False, "tcg"),      # a PVM host's /dev/kvm: it opens, the guest hangs
    ("auto", True, True, "kvm"),
    ("tcg", True, True, "tcg"),        # forced
    ("kvm", True, None, "kvm"),
])
def test_the_choice(requested, has_kvm, boots, expected):
    assert accel.choose(requested, has_kvm, boots) == expected


def test_a_choice_the_host_cannot_give_is_refused():
    with pytest.raises(accel.AccelError, match="/dev/kvm"):
        accel.choose("kvm", False, None)
    with pytest.raises(accel.AccelError, match="auto, kvm, tcg"):
        accel.choose("hvf", True, None)


async def test_the_probe_runs_once_per_host_key_and_only_when_it_can_matter(tmp_path):
    cache = tmp_path / "accel.json"
    probes = []

    async def probe(result=False):
        probes.append(1)
        return result
    assert await accel.resolve("auto", cache, "k1", probe, has_kvm=lambda: False) == "tcg"
    assert probes == [], "no device: nothing to probe"
    assert await accel.resolve("auto", cache, "k1", probe, has_kvm=lambda: True) == "tcg"
    assert await accel.resolve("auto", cache, "k1", probe, has_kvm=lambda: True) == "tcg"
    assert probes == [1], "remembered"
    assert json.loads(cache.read_text()) == {"k1": False}

    async def boots():
        probes.append(2)
        return True
    assert await accel.resolve("auto", cache, "k2", boots, has_kvm=lambda: True) == "kvm"   # another kernel
    assert probes == [1, 2]
    assert await accel.resolve("tcg", cache, "k3", boots, has_kvm=lambda: True) == "tcg"
    assert probes == [1, 2], "a forced choice probes nothing"
    cache.write_text("not json")
    assert await accel.resolve("auto", cache, "k2", boots, has_kvm=lambda: True) == "kvm"   # a torn cache: probed again
    assert probes == [1, 2, 2]
