"""A create's handling of a spec's nvctk.io/edits record, in-process: the earlier
record judged for this bundle (nvctk.runtime.earlier), the form applied, the new record
sealed for this bundle, as nvctk.runtime.commit does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nvctk.edits import Edits
from nvctk.runtime import earlier
from nvctk.spec import apply as spec_edits
from nvctk.spec.record import AppliedRecord


def apply_as_create(spec: dict[str, Any], edits: Edits, bundle: Path | str,
                    state: Path | str) -> tuple[AppliedRecord, int]:
    record = earlier.earlier_record(str(bundle), spec, str(state))
    spec_edits.check_record(record)
    return spec_edits.apply(spec, edits, record,
                            earlier.record_seal(str(bundle), str(state), edits))


def undo_as_create(spec: dict[str, Any], bundle: Path | str, state: Path | str | None) -> None:
    """A no-GPU create's removal of what an earlier create added (in memory)."""
    record = earlier.earlier_record(str(bundle), spec, None if state is None else str(state))
    spec_edits.remove_our_edits(spec, record)
