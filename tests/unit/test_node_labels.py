"""`nvctk labels --node-name`: the merge patch that keeps a Node's GFD-style labels
current (plain data): nvctk's labels set, those it set before and no longer applies
removed, nobody else's touched, no patch when nothing changed."""

from __future__ import annotations

from typing import Any

from nvctk.k8s.labels import OWNED, PRESENT, node_patch


def node(labels: dict[str, str], owned: str | None = None) -> dict[str, Any]:
    ann = {} if owned is None else {OWNED: owned}
    return {"metadata": {"name": "n1", "labels": labels, "annotations": ann}}


def test_first_patch_sets_labels_and_records_them() -> None:
    want = {PRESENT: "true", "nvidia.com/gpu.count": "2"}
    labels, ann = node_patch(node({"kubernetes.io/hostname": "n1"}), want) or ({}, {})
    assert labels == want
    assert ann == {OWNED: "nvidia.com/gpu.count,nvidia.com/gpu.present"}


def test_nothing_changed_is_no_patch() -> None:
    want = {PRESENT: "true", "nvidia.com/gpu.count": "2"}
    assert node_patch(node(dict(want), ",".join(sorted(want))), want) is None


def test_removes_only_its_own_stale_labels() -> None:
    have = {PRESENT: "true", "nvidia.com/mig-1g.10gb.count": "7",
            "nvidia.com/gpu.deploy.operands": "false",  # someone else's
            "kubernetes.io/hostname": "n1"}
    owned = f"{PRESENT},nvidia.com/mig-1g.10gb.count"
    labels, ann = node_patch(node(have, owned), {PRESENT: "true"}) or ({}, {})
    assert labels == {"nvidia.com/mig-1g.10gb.count": None}
    assert ann == {OWNED: PRESENT}


def test_a_changed_value_is_set_again() -> None:
    labels, _ = node_patch(node({PRESENT: "false"}, PRESENT), {PRESENT: "true"}) or ({}, {})
    assert labels == {PRESENT: "true"}


def test_labels_a_hand_set_label_takes_over() -> None:
    """An admin's nvidia.com/gpu.present=true (how a node without NFD is selected first)
    becomes nvctk's, kept current from then on."""
    labels, ann = node_patch(node({PRESENT: "true"}), {PRESENT: "true"}) or ({}, {})
    assert labels == {} and ann == {OWNED: PRESENT}
