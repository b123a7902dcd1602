"""A DRA share's hook refuses a container that may make a user namespace (nvctk.hook.
cdi_hooks.check_no_user_namespaces): by its seccomp profile, unless the kernel refuses
them anyway or the container is privileged. Plain data: the sysctls are files in tmp."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from nvctk.base.errors import SpecError
from nvctk.hook import cdi_hooks
from nvctk.spec.seccomp import userns_rules


def spec(seccomp: dict[str, Any] | None, privileged: bool = False) -> dict[str, Any]:
    caps = ["CAP_SYS_ADMIN"] if privileged else ["CAP_CHOWN"]
    out: dict[str, Any] = {"process": {"capabilities": {"bounding": caps}}, "linux": {}}
    if seccomp is not None:
        out["linux"]["seccomp"] = seccomp
    return out


REFUSING = {"defaultAction": "SCMP_ACT_ALLOW", "syscalls": userns_rules()}


@pytest.fixture
def sysctls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    files = (tmp_path / "max_user_namespaces", tmp_path / "unprivileged_userns_clone")
    files[0].write_text("65536\n")  # a kernel that allows them; the other sysctl absent
    monkeypatch.setattr(cdi_hooks, "USERNS_SYSCTLS", ((str(files[0]), "0"), (str(files[1]), "0")))
    return files


def test_no_profile_is_refused(sysctls: Any) -> None:
    with pytest.raises(SpecError, match="RuntimeDefault"):
        cdi_hooks.check_no_user_namespaces(spec(None))


def test_a_profile_that_refuses_user_namespaces_starts(sysctls: Any) -> None:
    cdi_hooks.check_no_user_namespaces(spec(REFUSING))


@pytest.mark.parametrize("which", [0, 1])
def test_a_kernel_that_refuses_them_starts_any_profile(sysctls: tuple[Path, Path], which: int) -> None:
    sysctls[which].write_text("0\n")
    cdi_hooks.check_no_user_namespaces(spec(None))


def test_a_privileged_container_is_not_capped_against_its_root(sysctls: Any) -> None:
    cdi_hooks.check_no_user_namespaces(spec(None, privileged=True))
