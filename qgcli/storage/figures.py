"""Writing a figure: atomically (temporary file + rename) or to a binary stream, in the format its file name
asks for (.png, .svg, .pdf), with the same bytes for the same figure.  matplotlib is imported only to write.
"""
import io
import os

import numpy as np

from qgcli.errors import OutputError
from qgcli.storage.stdio import write_all

FIGURE_FORMATS = {".png": "png", ".svg": "svg", ".pdf": "pdf"}


def figure_format(path):
    """'png', 'svg' or 'pdf' from the file name; an OutputError for anything else."""
    ext = os.path.splitext(str(path))[1].lower()
    if ext not in FIGURE_FORMATS:
        shown = ext or "no extension"
        raise OutputError(f"cannot tell the figure format from {shown!r} in {path}; use .png, .svg or .pdf",
                          operand="--output")
    return FIGURE_FORMATS[ext]


def save_figure(fig, path, dpi=100, *, format=None):
    """Write ``fig`` to ``path`` atomically (temp file + rename), or to a binary stream (``path`` with a
    ``write`` method, e.g. ``sys.stdout.buffer``).  The format is ``format`` or else the file extension.

    SVG and PDF carry no creation date and SVG ids are salted with a fixed string, so the same figure
    gives the same bytes.  The pixel size of a PNG is the figure size times ``dpi``, rounded to whole
    pixels (see :func:`_whole_pixel_inches`).
    """
    import matplotlib

    from qgcli.storage.io import atomic_write

    fmt = format or figure_format(path)
    metadata = {"png": {}, "svg": {"Date": None}, "pdf": {"CreationDate": None}}[fmt]
    drawn_printable(fig)

    def write(target):
        with matplotlib.rc_context({"svg.hashsalt": "qgcli"}):
            fig.savefig(target, format=fmt, dpi=dpi, metadata=metadata)

    def save():
        if not hasattr(path, "write"):
            atomic_write(str(path), write)
            return
        buffer = io.BytesIO()  # whole figure first: a failure leaves nothing half-written on the stream
        write(buffer)
        write_all(path, buffer.getvalue())

    if fmt != "png":
        save()
        return fmt
    inches = fig.get_size_inches().copy()
    fig.set_size_inches([_whole_pixel_inches(v, dpi) for v in inches], forward=False)
    try:
        save()
    finally:
        fig.set_size_inches(inches, forward=False)
    return fmt


def drawn_printable(fig):
    """Escape, in every text of ``fig``, the characters that are not printable (as Python's ``repr`` writes
    them, the rule of :func:`qgcli.report.text.printable`; line breaks stay): names from a file drawn in
    titles and labels can then put no control character into the figure, nor, through matplotlib's
    "Glyph 27 missing" warning, onto the terminal."""
    from matplotlib.text import Text
    from matplotlib.ticker import FixedFormatter, FuncFormatter

    for artist in fig.findobj(Text):
        text = artist.get_text()
        if isinstance(text, str) and not _printable(text):
            artist.set_text(_escaped(text))
    for ax in fig.axes:  # tick labels are made at draw time, from the axis' formatter
        for axis in (ax.xaxis, ax.yaxis):
            for get, put in ((axis.get_major_formatter, axis.set_major_formatter),
                             (axis.get_minor_formatter, axis.set_minor_formatter)):
                formatter = get()  # labels given as text (set_ticks(..., labels)), or names on a categorical axis
                if getattr(formatter, "qgcli_printable", False):
                    continue  # this figure was saved before
                if isinstance(formatter, (FixedFormatter, FuncFormatter)) or \
                        type(formatter).__name__ == "StrCategoryFormatter":
                    wrapped = FuncFormatter(lambda x, pos, f=formatter: _escaped(str(f(x, pos))))
                    wrapped.qgcli_printable = True
                    put(wrapped)


def _printable(text):
    return text.replace("\n", "").isprintable()


def _escaped(text):
    return text if _printable(text) else "".join(c if c.isprintable() or c == "\n" else repr(c)[1:-1] for c in text)


def _whole_pixel_inches(inches, dpi):
    """The size nearest ``inches`` whose product with ``dpi`` is ``round(inches * dpi)`` pixels or a hair above.

    Agg's canvas is ``int(inches * dpi)`` pixels (matplotlib 3.11 first rounds a product within 1e-8 of a whole
    number up): 8.2 in at 100 dpi is 819.9999999999999 px, which is 819 px on matplotlib <= 3.10 and 820 on 3.11.
    A product at or just above the whole number gives the same pixels on every version.

    >>> 8.2 * 100, _whole_pixel_inches(8.2, 100) * 100
    (819.9999999999999, 820.0000000000001)
    """
    pixels = round(float(inches) * dpi)
    snapped = pixels / dpi
    while snapped * dpi < pixels:
        snapped = float(np.nextafter(snapped, np.inf))
    return snapped
