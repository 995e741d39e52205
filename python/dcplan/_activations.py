"""Saved activations: what a sharded model's forward saves for its backward besides the gathered
parameters, as the recorder measures it (docs/recording.md, "Saved activations") and as a plan moves
it to the host (docs/planning.md, "Offload").

While recording, the ZeRO-3 eager hooks' pack and unpack (``_ShardState``) hand every other
saved tensor of the device of at least ``MIN_BYTES`` here. Per storage (views of one storage saved
again share it), a recorded micro-step counts its saves, its bytes, the op of the forward before
which it was first saved and the op of the backward before which it was first read; nothing else
changes. The first warm-up step is the trial: each storage goes to host memory as it is first
saved and comes back when the backward reads it, so that the device holds it only while something
besides autograd does (the module's own locals until it returns, the caller's for an output); the
save before which its memory was found gone says where offloading it frees it. A storage is known
again by its address only while it lives (a weak reference to it): a freed one's address may be
another's. $DCPLAN_RECORD_ACTIVATIONS=0 records none of it.

A plan's forward graph may name saves (offload_saves, by their first save): each training forward
of the model then copies those storages into host memory allocated when the plan was loaded
(``HostSlots``) as they are saved, and the backward copies each back when it first reads it, on
the stream that reads it; the views saved again of a storage share its copy.
"""
from __future__ import annotations

import os
import warnings
import weakref
from typing import Dict, List, Optional, Tuple

import torch

from . import _C, _offload, _record
from ._plan import PlanDepartureWarning

# Smaller saved tensors are not worth a copy of their own. One definition: the recorder and the
# runtime count the same saves.
MIN_BYTES = 64 << 10
ENV_RECORD_ACTIVATIONS = "DCPLAN_RECORD_ACTIVATIONS"


def recording_enabled() -> bool:
    """$DCPLAN_RECORD_ACTIVATIONS: "1" (the default) or "0"."""
    value = os.environ.get(ENV_RECORD_ACTIVATIONS, "1")
    if value not in ("0", "1"):
        raise ValueError(f'dcplan: ${ENV_RECORD_ACTIVATIONS} should be "0" or "1", got "{value}"')
    return value == "1"


def eligible(t: torch.Tensor, device: torch.device) -> bool:
    """Whether a saved tensor that is not a gathered parameter counts: a plain dense tensor (no
    subclass, no lazy conjugate or negation, whose copy would lose them) of the model's device (an
    index left open is the current one's) and of at least MIN_BYTES of storage."""
    if type(t) is not torch.Tensor or t.layout != torch.strided or t.is_nested or t.is_conj() or t.is_neg():
        return False
    if t.device.type != device.type or (device.index is not None and t.device.index != device.index):
        return False
    return t.untyped_storage().nbytes() >= MIN_BYTES


def _bytes_view(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _view(storage: torch.UntypedStorage, meta: Tuple) -> torch.Tensor:
    dtype, size, stride, offset = meta
    return torch.empty(0, dtype=dtype, device=storage.device).set_(storage, offset, size, stride)


def _meta(t: torch.Tensor) -> Tuple:
    return t.dtype, t.size(), t.stride(), t.storage_offset()


class _Entry:
    """One saved storage of a forward: its saves (pack indices), bytes and first op."""

    __slots__ = ("packs", "bytes", "seq", "used_at", "alive", "host", "back", "reads", "freed_before")

    def __init__(self, pack: int, storage: torch.UntypedStorage, seq: int):
        self.packs = [pack]
        self.bytes = storage.nbytes()
        self.seq = seq
        self.used_at: Optional[int] = None
        self.alive = weakref.ref(storage)  # the device storage, while it lives
        self.host: Optional[torch.Tensor] = None  # its copy on the host (the trial's, or a plan's slot)
        # Its copy back on the device, kept from the backward's first read of it until each of its
        # saves has been read once (as autograd held the storage it was saved from), and reads since.
        self.back: Optional[torch.UntypedStorage] = None
        self.reads = 0
        self.freed_before: Optional[int] = None  # the trial: the save before which it was gone


class _Saved:
    """What pack returns for a counted save: the tensor itself in a recorded step, its entry and
    view in the trial (the device copy then lives only as long as other holders keep it)."""

    __slots__ = ("forward", "entry", "tensor", "meta")

    def __init__(self, forward: "Forward", entry: _Entry, tensor: Optional[torch.Tensor], meta: Optional[Tuple]):
        self.forward, self.entry, self.tensor, self.meta = forward, entry, tensor, meta


class HostSlots:
    """The host memory of a plan's saves of one forward graph (its offload_saves: (pack, bytes)
    each), allocated once when the plan is loaded, before step 0: pinned for a GPU's model, on CPU
    ranks outside torch's allocator, which counts as the device's memory there. One forward at a
    time uses it: until its saves are gone (its backward ran, or its graph was dropped)."""

    def __init__(self, plan: str, pointer: str, saves: List[Tuple[int, int]], device: torch.device):
        self.plan, self.pointer = plan, pointer  # the file, and its graph's offload_saves
        self.user: Optional[weakref.ref] = None  # the Forward whose saves may still be read
        self.warned = self.warned_held = False
        # One block, each save's slot an aligned view of it (the optimizer state's pools' rule).
        pool = _offload._HostPool(plan, -1, self._room(saves), 0, device)
        self.slots: Dict[int, torch.Tensor] = {pack: pool.take((nbytes,), torch.uint8) for pack, nbytes in saves}
        self.index = {pack: k for k, (pack, _) in enumerate(saves)}  # the save's item in offload_saves
        self.last = max(self.slots, default=-1)  # the plan's last save: a forward saves at least as many

    @staticmethod
    def _room(saves: List[Tuple[int, int]]) -> int:
        """The slots' bytes, each rounded up to the pools' alignment."""
        return sum(_offload.aligned(nbytes) for _, nbytes in saves)

    def forward(self, forward_graph: int, backward_graph: int, device: torch.device) -> Optional["Forward"]:
        """A training forward's saves, the plan's moved here; None (warned once) while an earlier
        forward's saves are still held (two forwards before their backwards, retain_graph): its
        copies would be overwritten, so this one keeps its saves on the device."""
        if self.user is not None and self.user() is not None:
            if not self.warned_held:
                self.warned_held = True
                warnings.warn(f"dcplan: {self.plan}: a forward of graph {forward_graph} began while an earlier "
                              "one's saved activations were still held (a second forward before its backward, "
                              "or a graph kept with retain_graph): it keeps its saves on the device, beyond the "
                              "plan's memory", PlanDepartureWarning, stacklevel=4)
            return None
        forward = Forward(forward_graph, backward_graph, device, False, self)
        self.user = weakref.ref(forward)
        return forward

    def depart(self, what: str) -> None:
        """A forward's saves differed from the plan's (what): said once; that forward moved what it had."""
        if not self.warned:
            self.warned = True
            warnings.warn(f"dcplan: {self.plan}: a forward's saves differ from the plan's: {what}; the saves "
                          "from there on stay on the device (the model or its inputs differ from the recording)",
                          PlanDepartureWarning, stacklevel=5)

    @classmethod
    def host_bytes(cls, saves: List[Tuple[int, int]]) -> int:
        """What HostSlots asks the host for, for these saves."""
        return _offload._HostPool.request(cls._room(saves), 0)


class Forward:
    """The saves of one forward of a sharded model: while recording, a recorded micro-step's
    (trial False) or the trial's; with a plan that offloads some, `slots` (HostSlots) those."""

    def __init__(self, forward_graph: int, backward_graph: int, device: torch.device, trial: bool,
                 slots: Optional[HostSlots] = None):
        self.forward_graph, self.backward_graph = forward_graph, backward_graph
        self.device, self.trial, self.slots = device, trial, slots
        self.moves = trial or slots is not None  # saves go to the host and back
        self.entries: List[_Entry] = []
        self.by_address: Dict[int, _Entry] = {}
        self.pack_seq: List[int] = []  # the op of the forward before which each save came
        self.ops_at_end = -1
        self.departed = False  # a planned save differed from the plan: no more moves this forward

    def _known(self, storage: torch.UntypedStorage) -> Optional[_Entry]:
        entry = self.by_address.get(storage.data_ptr())
        return entry if entry is not None and entry.alive() is storage else None

    def _note_freed(self) -> None:
        """The trial: entries whose device memory is gone by the save about to be counted."""
        index = len(self.pack_seq)
        for e in self.entries:
            if e.freed_before is None and e.alive() is None:
                e.freed_before = index

    def pack(self, t: torch.Tensor):
        """A save of the forward: t (not a gathered parameter). The recorder's (no slots) is its
        own work, which the trace's host times leave out."""
        return self._pack(t) if self.slots is not None else _record.own_work(self._pack, t)

    def _pack(self, t: torch.Tensor):
        if not eligible(t, self.device):
            return t
        if self.trial:
            self._note_freed()
        index = len(self.pack_seq)
        self.pack_seq.append(-1 if self.moves else _C.record_position(self.forward_graph))
        storage = t.untyped_storage()
        entry = self._known(storage)
        if entry is not None:
            entry.packs.append(index)
        elif self.slots is not None:
            entry = self._planned(index, storage)
            if entry is None:
                return t
        else:
            host = torch.empty(storage.nbytes(), dtype=torch.uint8, device="cpu") if self.trial else None
            entry = self._add(index, storage, self.pack_seq[-1], host)
        return _Saved(self, entry, None, _meta(t)) if self.moves else _Saved(self, entry, t, None)

    def _planned(self, index: int, storage: torch.UntypedStorage) -> Optional[_Entry]:
        """A plan's save at its first save, copied into its slot; None where the plan moves none
        there, or no more (a save that differed from the plan's, warned once)."""
        slot = None if self.departed else self.slots.slots.get(index)
        if slot is None:
            return None
        if storage.nbytes() != slot.numel():
            self.departed = True
            self.slots.depart(f"save {index} holds {storage.nbytes()} bytes, "
                              f"{self.slots.pointer}/{self.slots.index[index]}/bytes {slot.numel()}")
            return None
        return self._add(index, storage, -1, slot)

    def _add(self, index: int, storage: torch.UntypedStorage, seq: int, host: Optional[torch.Tensor]) -> _Entry:
        """A storage first saved at save `index`, known by its address from here; copied into `host`
        where it moves (queued behind the compute on a GPU)."""
        entry = _Entry(index, storage, seq)
        if host is not None:
            entry.host = host
            host.copy_(_bytes_view(storage), non_blocking=storage.device.type == "cuda" and host.is_pinned())
        self.entries.append(entry)
        self.by_address[storage.data_ptr()] = entry
        return entry

    def end(self) -> None:
        """The forward has returned."""
        if self.trial:
            self._note_freed()
        elif self.slots is None:
            self.ops_at_end = _C.record_position(self.forward_graph)
        elif not self.departed and len(self.pack_seq) <= self.slots.last:
            self.slots.depart(f"it saved {len(self.pack_seq)} tensors, and {self.slots.pointer} names save "
                              f"{self.slots.last}")

    def unpack(self, saved: _Saved) -> torch.Tensor:
        return self._unpack(saved) if self.slots is not None else _record.own_work(self._unpack, saved)

    def _unpack(self, saved: _Saved) -> torch.Tensor:
        entry = saved.entry
        if not self.moves:
            if entry.used_at is None:
                entry.used_at = _C.record_position(self.backward_graph)
            return saved.tensor
        storage = entry.back
        if storage is None:  # its first read (or the first of another backward over a kept graph)
            device = torch.empty(entry.bytes, dtype=torch.uint8, device=self.device)
            device.copy_(entry.host, non_blocking=self.device.type == "cuda")
            storage = entry.back = device.untyped_storage()
            entry.reads = 0
        entry.reads += 1
        if entry.reads >= len(entry.packs):  # from here the views handed out hold it
            entry.back = None
        return _view(storage, saved.meta)

    def findings(self) -> "Trial":
        """The trial's findings, for the recorded micro-steps of the same forward."""
        return Trial(len(self.pack_seq), {e.packs[0]: (e.bytes, e.freed_before) for e in self.entries})

    def report(self, trial: Optional["Trial"]) -> List[tuple]:
        """A recorded micro-step's entries for the trace, each (packs, bytes, seq, freed_at, used_at):
        freed_at where the trial saved as often and the same storage first at the same save, and
        found its memory gone by the forward's end."""
        same = trial is not None and trial.saves == len(self.pack_seq)
        out = []
        for e in self.entries:
            found = trial.freed.get(e.packs[0]) if same else None
            freed_at = None
            if found is not None and found[0] == e.bytes and found[1] is not None:
                freed_at = self.pack_seq[found[1]] if found[1] < len(self.pack_seq) else self.ops_at_end
            out.append((list(e.packs), e.bytes, e.seq, freed_at, e.used_at))
        return out


class Trial:
    """What a trial forward found: its count of saves, and by first save each storage's bytes and
    the save before which its memory was gone (`saves`: by the forward's end; None: held then)."""

    def __init__(self, saves: int, freed: Dict[int, Tuple[int, Optional[int]]]):
        self.saves, self.freed = saves, freed


def unpack(x):
    """The hooks' unpack for what Forward.pack returned (anything else comes back as it is)."""
    return x.forward.unpack(x) if isinstance(x, _Saved) else x
