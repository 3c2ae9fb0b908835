"""The patch registry.

Every torch attribute that torch_patches replaces is described by one
:class:`~torch_patches._registry.records.Patch` record (``patches.py``): what it replaces,
with what, for which torch versions, which upstream code it stands in for, when it can be
retired, and a fingerprint of the upstream function(s) it was written against
(``fingerprints.py``, ``fingerprints.json``).  Global effects that are not attribute
replacements are :class:`~torch_patches._registry.records.Effect` records beside them.
``install.py`` applies and unapplies them (all or nothing) and reports their status.

    records.py  <-  fingerprints.py  <-  patches.py  <-  install.py
"""

from torch_patches._registry.fingerprints import combine_fingerprints, find_definition, fingerprint_source
from torch_patches._registry.install import (
    AREAS,
    PatchError,
    UnapplyError,
    applied_patches,
    apply,
    check_fingerprint,
    get_original,
    installed_effects,
    is_applied,
    live_fingerprint,
    status,
    unapply,
)
from torch_patches._registry.records import (
    SUPPORTED_TORCH,
    Effect,
    Patch,
    PatchStatus,
    UpstreamForm,
    parse_version,
    torch_version,
    validate_records,
)

__all__ = [
    "AREAS",
    "Effect",
    "Patch",
    "PatchError",
    "PatchStatus",
    "SUPPORTED_TORCH",
    "UnapplyError",
    "UpstreamForm",
    "applied_patches",
    "apply",
    "check_fingerprint",
    "combine_fingerprints",
    "find_definition",
    "fingerprint_source",
    "get_original",
    "installed_effects",
    "is_applied",
    "live_fingerprint",
    "parse_version",
    "status",
    "torch_version",
    "unapply",
    "validate_records",
]
