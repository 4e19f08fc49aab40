"""TensorBoard event-file I/O for ``deepep-compare``: every scalar of a run exactly as stored, and a layout.

How a run path is resolved (also printed by ``deepep-compare --help``):

* a file is read as the run's only event file;
* a directory is searched recursively for files whose name contains ``tfevents``. If they lie in
  two or more Lightning ``version_N`` directories, the path is ambiguous and rejected (pass one
  ``version_N`` directory). The run root is the deepest directory holding all event files; tags of
  files in a sub-directory of the root (``SummaryWriter.add_scalars`` writes those) are prefixed
  with the sub-directory, ``"grp_a/grp"``;
* several event files in one directory (a resumed writer) are merged in file-name order, as
  TensorBoard does; when a step of a tag was written twice, the later value wins.

Values are kept in their stored dtype (float32 for both ``simple_value`` and new-style tensor
scalars) so that callers can compare bit patterns. Every file is first scanned record by record
with TensorBoard's own record reader: a truncated or corrupt record (``DataLossError``), which
``EventAccumulator`` would swallow silently, raises :class:`EventFileError` instead.
"""

import os
import re
from dataclasses import dataclass, field

import numpy as np
from tensorboard.backend.event_processing import plugin_event_accumulator
from tensorboard.compat.tensorflow_stub import errors as tb_errors
from tensorboard.compat.tensorflow_stub import pywrap_tensorflow
from tensorboard.util import tensor_util

__all__ = [
    "EventFileError",
    "RunScalars",
    "ScalarSeries",
    "find_event_files",
    "read_run",
    "write_custom_scalars_layout",
]

_SCALARS_PLUGIN = "scalars"
_VERSION_DIR = re.compile(r"^version_\d+$")


class EventFileError(RuntimeError):
    """An event file is empty, truncated or corrupt, or a run holds no scalar data."""


@dataclass(frozen=True)
class ScalarSeries:
    """One tag of one run: ``steps`` sorted and unique (int64), ``values`` in the stored dtype."""

    steps: np.ndarray
    values: np.ndarray


@dataclass
class RunScalars:
    """All scalar series of one run.

    Attributes:
        path: the path as given.
        root: the directory the tags are relative to (the file's directory for a single file).
        event_files: the event files read, in merge order.
        series: ``tag -> ScalarSeries``.
        overwritten_points: how many (tag, step) points were written more than once; the later won.
    """

    path: str
    root: str
    event_files: list[str]
    series: dict[str, ScalarSeries] = field(default_factory=dict)
    overwritten_points: int = 0


def find_event_files(path: str) -> tuple[str, list[str]]:
    """Return ``(root, event_files)`` for a run path, following the rules in the module docstring.

    Raises:
        FileNotFoundError: ``path`` does not exist or holds no event file.
        ValueError: ``path`` holds several Lightning ``version_N`` directories.
    """
    if os.path.isfile(path):
        return os.path.dirname(os.path.abspath(path)), [os.path.abspath(path)]
    if not os.path.isdir(path):
        raise FileNotFoundError(f"run {path!r} does not exist (expected a run directory or an event file)")
    files: list[str] = []
    for dirpath, dirnames, filenames in os.walk(path):
        dirnames.sort()
        files.extend(os.path.join(dirpath, name) for name in sorted(filenames) if "tfevents" in name)
    if not files:
        raise FileNotFoundError(
            f"run {path!r} holds no TensorBoard event file (no file named '*tfevents*' in it or below). "
            "HINT: pass the logger's save_dir, its version_N directory, or an event file."
        )
    versions = sorted({version for f in files if (version := _version_dir_of(f, path)) is not None})
    if len(versions) > 1:
        shown = ", ".join(os.path.relpath(v, path) for v in versions)
        raise ValueError(
            f"run {path!r} holds several Lightning versions ({shown}); which one is the run is ambiguous. "
            f"HINT: pass one of them, e.g. {os.path.join(path, os.path.relpath(versions[-1], path))!r}."
        )
    root = os.path.commonpath([os.path.dirname(os.path.abspath(f)) for f in files])
    files = [os.path.abspath(f) for f in files]
    # Merge order: files of the root first, then sub-directories; by name inside each (TensorBoard's order).
    files.sort(key=lambda f: (os.path.relpath(os.path.dirname(f), root) != ".", os.path.dirname(f), f))
    return root, files


def read_run(path: str) -> RunScalars:
    """Read all scalar series of the run at ``path``.

    Args:
        path: a run directory, a Lightning ``version_N`` directory (or a directory above exactly one),
            or a single event file.

    Raises:
        FileNotFoundError: see :func:`find_event_files`.
        EventFileError: an event file is empty or corrupt, or the run holds no scalar data.
    """
    root, files = find_event_files(path)
    run = RunScalars(path=path, root=root, event_files=files)
    points: dict[str, dict[int, np.generic]] = {}
    for event_file in files:
        _check_records(event_file)
        prefix = os.path.relpath(os.path.dirname(event_file), root)
        prefix = "" if prefix == "." else prefix.replace(os.sep, "/") + "/"
        for tag, step, value in _scalar_events(event_file):
            per_step = points.setdefault(prefix + tag, {})
            run.overwritten_points += step in per_step
            per_step[step] = value
    for tag, per_step in sorted(points.items()):
        steps = np.array(sorted(per_step), dtype=np.int64)
        dtype = np.result_type(*{v.dtype for v in per_step.values()})
        run.series[tag] = ScalarSeries(steps, np.array([per_step[s] for s in steps.tolist()], dtype=dtype))
    if not run.series:
        raise EventFileError(
            f"run {path!r} holds no scalar data in its {len(files)} event file(s) (first: {files[0]!r})"
        )
    return run


def _version_dir_of(event_file: str, top: str) -> str | None:
    """The nearest ``version_N`` directory at or below ``top`` that contains ``event_file``, if any."""
    relative = os.path.relpath(os.path.dirname(event_file), top)
    parts = [] if relative == "." else relative.split(os.sep)
    for depth in range(len(parts), 0, -1):
        if _VERSION_DIR.match(parts[depth - 1]):
            return os.path.join(top, *parts[:depth])
    return None


def _check_records(event_file: str) -> int:
    """Read every record with TensorBoard's reader (CRC-checked); return how many there are."""
    if os.path.getsize(event_file) == 0:
        raise EventFileError(
            f"event file {event_file!r} is empty (0 bytes): its writer never flushed, was the run killed? "
            "HINT: delete the file if the run's other event files are complete."
        )
    # The pure-Python reader TensorBoard uses without TensorFlow; it checks both CRCs of every record.
    reader = pywrap_tensorflow.PyRecordReader_New(event_file, 0, None, None)
    count = 0
    try:
        while True:
            try:
                reader.GetNext()
            except tb_errors.OutOfRangeError:
                return count
            except tb_errors.DataLossError as error:
                raise EventFileError(
                    f"event file {event_file!r} is corrupt after {count} good record(s) ({error.message}); "
                    "TensorBoard would silently show only the records before it. HINT: a truncated record "
                    "means the writer was killed mid-write; a failed crc32 check, that the bytes changed."
                ) from None
            count += 1
    finally:
        reader.file_handle.close()


def _scalar_events(event_file: str):
    """Yield ``(tag, step, value)`` for every scalar in one event file, value as a numpy scalar."""
    accumulator = plugin_event_accumulator.EventAccumulator(
        event_file,
        size_guidance={plugin_event_accumulator.TENSORS: 0},  # 0 = keep every event
        tensor_size_guidance={_SCALARS_PLUGIN: 0},
        purge_orphaned_data=False,  # keep what was written; we resolve repeated steps ourselves
    )
    accumulator.Reload()
    if _SCALARS_PLUGIN not in accumulator.ActivePlugins():
        return
    for tag in accumulator.PluginTagToContent(_SCALARS_PLUGIN):
        for event in accumulator.Tensors(tag):
            array = tensor_util.make_ndarray(event.tensor_proto)
            if array.size != 1:
                continue  # not a scalar despite the plugin name; nothing to compare as a curve
            array = array.reshape(())
            if array.dtype.kind != "f":
                value = np.float64(array)  # integer or bool scalars; exact up to 2**53
            elif array.dtype.itemsize < 4:
                value = np.float32(array)  # float16 and bfloat16 widen exactly
            else:
                value = array[()]
            yield tag, int(event.step), value


def write_custom_scalars_layout(logdir: str, groups: dict[str, list[str]]) -> str:
    """Write a custom-scalars layout event file into ``logdir``; return its path.

    Args:
        logdir: directory to write into (created if needed).
        groups: category title -> tags; each tag becomes one chart that overlays it across all runs.
    """
    from tensorboard.compat.proto import event_pb2, summary_pb2, tensor_pb2, tensor_shape_pb2
    from tensorboard.plugins.custom_scalar import layout_pb2, metadata
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

    def chart(tag):
        overlay = layout_pb2.MultilineChartContent(tag=[f"^{re.escape(tag)}$"])  # the regex matches one tag
        return layout_pb2.Chart(title=tag, multiline=overlay)

    categories = [
        layout_pb2.Category(title=title, chart=[chart(tag) for tag in tags]) for title, tags in groups.items() if tags
    ]
    layout = layout_pb2.Layout(category=categories).SerializeToString()
    tensor = tensor_pb2.TensorProto(
        dtype="DT_STRING", tensor_shape=tensor_shape_pb2.TensorShapeProto(), string_val=[layout]
    )
    value = summary_pb2.Summary.Value(
        tag=metadata.CONFIG_SUMMARY_TAG, tensor=tensor, metadata=metadata.create_summary_metadata()
    )
    before = set(os.listdir(logdir)) if os.path.isdir(logdir) else set()
    writer = EventFileWriter(logdir, filename_suffix=".deepep-compare")
    writer.add_event(event_pb2.Event(step=0, summary=summary_pb2.Summary(value=[value])))
    writer.close()
    (written,) = set(os.listdir(logdir)) - before
    return os.path.join(logdir, written)
