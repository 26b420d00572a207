"""What DALI's pipelines read (dlojz_lib/data/dali.py): the sampler's batches of file paths or, from packed shards,
file bytes (`SampleFeed`, an external source that runs on from epoch to epoch), one epoch's files for DALI's file
reader (`EpochFiles`: --dali-cache, whose decoder keys each image by the path the reader sets), and the validation
files that are not whole JPEG or PNG files (`cut_short`, `leave_out_cut_short`), left out as the pytorch backend
leaves them out.
"""

import collections
import copy
import dataclasses
import io
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np

READ_THREADS = 8  # packed shards: pread releases the GIL, a few threads keep the source ahead of the decoder
READ_AHEAD = 3  # packed shards: batches read before DALI asks for them


def whole_image(data):
    """A whole JPEG (start and end markers) or PNG: what is worth handing to DALI's decoder."""
    return (data[:3] == b"\xff\xd8\xff" and data.rstrip(b"\x00")[-2:] == b"\xff\xd9") or data[
        :8
    ] == b"\x89PNG\r\n\x1a\n"


def head_and_tail(path, tail=4096):
    """A file's first 8 bytes and its last `tail`: enough for whole_image, without reading the file."""
    with open(path, "rb") as file:
        head = file.read(8)
        size = file.seek(0, 2)
        file.seek(max(8, size - tail))
        return head + file.read()


def oversized(data):
    """PIL's refusal of an image whose header gives more pixels than its decompression-bomb limit (a 65,000 x 65,000
    JPEG), which the pytorch backend's decode skips as unreadable: the same rule for DALI's. None otherwise."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)):
            return None
    except Image.DecompressionBombError as err:
        return str(err)
    except Exception:  # another header problem: the decoder's to find
        return None


def cut_short(dataset) -> list:
    """(index, reason) of the validation images of a folder `dataset` that are not whole JPEG or PNG files (a
    truncated JPEG, which DALI decodes with grey where its bytes are missing and PIL refuses; an empty file). Their
    first and last bytes are read, not the files; packed shards hold the images dlojz_pack.py decoded: none."""
    if not all(isinstance(where, str) for where, _ in dataset.samples):
        return []
    found = []
    for index, (where, _) in enumerate(dataset.samples):
        try:
            if not whole_image(head_and_tail(where)):
                found.append((index, "not a whole JPEG or PNG file"))
        except OSError as err:
            found.append((index, str(err)))
    return found


def leave_out_cut_short(dataset, found, warn=True):
    """`dataset` without the images cut_short found (each warned about by name when `warn`), so that DALI's
    validation counts and scores the images the pytorch backend does (which leaves them out as unreadable)."""
    if not found:
        return
    for index, reason in found if warn else ():
        print(f"WARNING: skipping unreadable image {dataset.samples[index][0]}: {reason}", file=sys.stderr, flush=True)
    left_out = {index for index, _ in found}
    kept = [sample for index, sample in enumerate(dataset.samples) if index not in left_out]
    dataset.samples = dataset.imgs = kept
    dataset.targets = [target for _, target in kept]


class SampleFeed:
    """The external source: batches of (file paths or file bytes, labels) in the sampler's order, from `start` (an
    epoch and the samples of it already seen) on, epoch after epoch without end (validation: the same pass again),
    so that DALI prepares the next epoch's first batches while this one ends. It keeps its own copy of the sampler.
    A folder data set gives paths (DALI's threads read them); packed shards give bytes, read by a thread pool."""

    def __init__(self, dataset, sampler, batch_size, start=(0, 0), drop_last=False):
        self.dataset, self.sampler, self.batch_size = dataset, copy.copy(sampler), batch_size
        self.start, self.drop_last = start, drop_last
        self.by_path = all(isinstance(where, str) for where, _ in dataset.samples)
        self.skipped = set()  # samples found unreadable: each replaced by the next readable one
        self.pool = None

    def index_batches(self, start):
        """The data set's indices, a batch at a time, from `start` = (epoch, samples already seen) on."""
        epoch, skip = start
        while True:
            yield from self.epoch_batches(epoch, skip)
            epoch, skip = epoch + 1, 0

    def epoch_batches(self, epoch, skip):
        """One epoch's indices, a batch at a time, from its `skip` samples already seen on."""
        if hasattr(self.sampler, "set_epoch"):  # training: each pass is the next epoch
            self.sampler.set_epoch(epoch)
            self.sampler.skip = 0
        indices = [index for _, index in iter(self.sampler)][skip:]
        end = len(indices) - len(indices) % self.batch_size if self.drop_last else len(indices)
        if end == 0 and skip == 0:
            raise ValueError(f"DALI: no whole batch of {self.batch_size} in an epoch of {len(indices)} samples")
        for first in range(0, end, self.batch_size):
            yield [self.readable(index) for index in indices[first : first + self.batch_size]]

    def epoch_files(self, start) -> "EpochFiles":
        """The files of `start`'s epoch from its samples already seen on, for DALI's file reader (a folder data
        set's: packed shards have no paths)."""
        indices = [index for batch in self.epoch_batches(*start) for index in batch]
        samples = [self.dataset.samples[index] for index in indices]
        return EpochFiles([path for path, _ in samples], [int(label) for _, label in samples], start[0])

    def readable(self, index):
        """`index`, or the next sample not found unreadable (as the pytorch backend skips a corrupt file)."""
        n = len(self.dataset.samples)
        for attempt in range(n):
            if (index + attempt) % n not in self.skipped:
                return (index + attempt) % n
        raise OSError(f"no readable image in {self.dataset.root}")

    def labels(self, indices):
        return np.asarray([self.dataset.samples[i][1] for i in indices], dtype=np.int64).reshape(-1, 1)

    def __iter__(self):
        batches = self.index_batches(self.start)
        if self.by_path:
            for indices in batches:
                paths = [np.frombuffer(self.dataset.samples[i][0].encode(), dtype=np.uint8) for i in indices]
                yield paths, self.labels(indices)
        else:
            yield from self._read_ahead(batches)

    def _read_ahead(self, batches):
        """DALI calls the source from the thread that runs the pipeline: the next READ_AHEAD batches' samples are
        read meanwhile by the thread pool, in chunks (a future per sample costs ~20 us of that thread)."""
        if self.pool is None:
            self.pool = ThreadPoolExecutor(READ_THREADS)
        pending = collections.deque()
        chunk = max(1, -(-self.batch_size // READ_THREADS))
        for indices in batches:
            pending.append(
                (
                    indices,
                    [self.pool.submit(self._read_many, indices[k : k + chunk]) for k in range(0, len(indices), chunk)],
                )
            )
            if len(pending) > READ_AHEAD:
                indices, futures = pending.popleft()
                yield [data for future in futures for data in future.result()], self.labels(indices)

    def _read_many(self, indices):
        return [np.frombuffer(self.dataset.read_bytes(i), dtype=np.uint8) for i in indices]

    def unreadable(self, start, batches):
        """The samples of `batches` batches from `start` on that are not whole JPEG or PNG files, or whose header
        gives more pixels than PIL takes (oversized), each warned about by name: what a failed DALI pipeline was
        preparing."""
        found = set()
        for _, indices in zip(range(batches), self.index_batches(start)):
            for i in indices:
                try:
                    data = self.dataset.read_bytes(i)
                    if not whole_image(data):
                        raise OSError("not a whole JPEG or PNG file")
                    if (bomb := oversized(data)) is not None:  # the pytorch backend's PIL refuses it too
                        raise OSError(bomb)
                except OSError as err:
                    print(
                        f"WARNING: skipping unreadable image {self.dataset.describe(i)}: {err}",
                        file=sys.stderr,
                        flush=True,
                    )
                    found.add(i)
        return found

    def __getstate__(self):  # the thread pool stays in the process that made it
        return dict(self.__dict__, pool=None)


@dataclasses.dataclass(frozen=True)
class EpochFiles:
    """One epoch's files (this rank's, in the sampler's order, from the samples already seen) and labels, read by
    DALI's file reader: it sets each sample's source_info to its path, the key under which the decoder's cache keeps
    the decoded image (an external source's bytes have none, and DALI caches nothing without a key). `epoch` seeds
    the pipeline's draws: one pipeline an epoch."""

    paths: list
    labels: list
    epoch: int = 0
