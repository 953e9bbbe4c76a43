"""How a run file's groups reach a format that has no groups (.npz, safetensors, ``DIR/``, ``-``): each
output under the flat key ``group/name``.  (HDF5 and Zarr have groups, and sinks of their own.)"""


class FlatSink:
    """``add(path, arrays, attrs)`` puts each array under ``path/name``; the op's attributes are not kept
    (these formats carry none per group)."""

    streams = False  # the groups are computed in memory, then added

    def __init__(self, put):
        self.put = put  # put(key, array)

    def begin(self, path):
        return None

    def add(self, path, arrays, attrs):
        for name, array in arrays.items():
            self.put(f"{path}/{name}", array)

    def discard(self, path):
        pass
