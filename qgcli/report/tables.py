"""Tables and lines that fit the terminal and are never cut.

Every renderer prints its tables through :func:`print_table` and its long lines through :func:`print_items`:

* on a terminal the table keeps only the columns that fit, dropping the least important first, says once
  which columns it left out and how to get them (``--wide``, ``--columns``), and explains the abbreviated
  headers it shows; when even the essential columns do not fit (or ``--wide`` asks for more than the width
  holds) it prints one record per block, ``label  value`` on a line;
* when the output is not a terminal (a pipe, a log file) every column is printed and lines are never wrapped,
  whatever the width.

A cell is never truncated: each column is as wide as its widest cell.  Cells are plain strings (never parsed as
rich markup; they come from :func:`qgcli.report.text.printable_doc` documents) or :class:`rich.text.Text`.

Kept free of heavy imports at module level: rich is imported when a table is printed.
"""
from dataclasses import dataclass

from qgcli.errors import OptionError

GAP = 2  # spaces between columns

# What --wide / --columns asked for: set by qgcli.cli.options.table_options' callbacks, read by print_table(choice=True).
CHOICE = {"wide": False, "columns": None}


@dataclass(frozen=True)
class Col:
    """A table column: ``name`` (the header and the ``--columns`` name), ``justify``, ``help`` (the legend
    for an abbreviated header, printed once under the table when the column is shown) and ``priority``:
    0 is never dropped to fit, higher numbers are dropped first."""
    name: str
    justify: str = "right"
    help: str = ""
    priority: int = 1
    prefix: bool = False  # the first column: its name heads each record in block form ("ch 3")
    #: a column of ``/``-separated paths (layer names): on a terminal too narrow for them, shortened from the
    #: middle (``step_000100/…/conv1/act_quant``) rather than left out, never to two equal texts
    shorten: bool = False


ELLIPSIS = "…"
#: A path column is not shortened below this many cells (or its widest cell, if narrower) to keep columns of
#: priority 2 and more: those are dropped first.
PATH_FLOOR = 32


def shorten_middle(text, budget):
    """``text`` (a ``/``-separated path) in at most ``budget`` cells, the middle left out: whole segments
    where they fit (the first, and as many of the last as fit: the last names the layer), else characters
    from the middle of the text. ``text`` itself when it fits."""
    if len(text) <= budget:
        return text
    parts = text.split("/")
    best = None
    for tail in range(1, len(parts)):
        for head in range(1, len(parts) - tail):
            candidate = "/".join(parts[:head]) + "/" + ELLIPSIS + "/" + "/".join(parts[-tail:])
            if len(candidate) <= budget and (best is None or len(candidate) > len(best)):
                best = candidate
    if best is not None:
        return best
    keep = max(budget - 1, 2)
    tail = max(1, (2 * keep) // 3)
    return text[:keep - tail] + ELLIPSIS + text[-tail:]


def shorten_paths(texts, budget):
    """Each text shortened to ``budget`` (:func:`shorten_middle`), never two different texts to the same
    one: those that would collide get more room, up to their whole text."""
    out = {t: shorten_middle(t, budget) for t in set(texts)}
    room = budget
    while True:
        seen = {}
        for t, s in out.items():
            seen.setdefault(s, []).append(t)
        clashes = [t for ts in seen.values() if len(ts) > 1 for t in ts]
        if not clashes:
            return [out[t] for t in texts]
        room += 4
        for t in clashes:
            out[t] = shorten_middle(t, room)


def plain(console):
    """True when ``console`` does not write to a terminal: print full lines, every column."""
    return not console.is_terminal


def parse_columns(text, cols, *, param_hint="--columns", others=()):
    """The names of ``--columns a,b,c`` checked against ``cols`` (``all`` is every column); None for None.
    ``others``: the column names of the command's other table (a report's trend table): accepted and left to
    that table; None when every name given is one of those."""
    if text is None:
        return None
    names = [c.name for c in cols]
    chosen, elsewhere = [], False
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        if part == "all":
            chosen.extend(n for n in names if n not in chosen)
        elif part in names:
            if part not in chosen:
                chosen.append(part)
        elif part in others:
            elsewhere = True
        else:
            choices = names + [n for n in others if n not in names]
            raise OptionError(f"no column {part!r}; choose from {', '.join(choices)} (or all)",
                                     param_hint=param_hint)
    if not chosen:
        if elsewhere:
            return None
        raise OptionError("name at least one column", param_hint=param_hint)
    return chosen


def _text(cell):
    from rich.text import Text

    if isinstance(cell, Text):
        return cell
    return Text("" if cell is None else str(cell))


def print_table(console, cols, rows, *, wide=False, columns=None, styles=None, title=None, legend=True,
                hint="--wide or --columns", choice=False, choice_others=(), whole="--wide"):
    """Print ``rows`` (lists of cells, one per column of ``cols``) as a table that fits ``console``.

    ``wide``: every column; ``columns``: the column names to show, in that order (see :func:`parse_columns`);
    ``choice``: apply the command's ``--wide`` / ``--columns`` (:func:`qgcli.cli.options.table_options`) to this table
    (``choice_others``: the names of its other table's columns, see :func:`parse_columns`);
    ``styles``: a rich style per row (or None); ``title``: a line printed above; ``hint``: how to get the
    columns left out, ``whole``: the paths shortened (:attr:`Col.shorten`).  The first column is the
    record's label (``ch 3``, a tensor's name) and is always shown.  Returns the names of the columns shown.
    """
    from rich.text import Text

    if choice:
        wide = wide or bool(CHOICE["wide"])
        if columns is None and CHOICE["columns"] is not None:
            columns = parse_columns(CHOICE["columns"], cols, others=choice_others)
    is_plain = plain(console)
    if is_plain:  # no styles off a terminal: the cells' text only, measured here and written by _write_plain
        from rich.cells import cell_len

        widths = [len(c.name) for c in cols]
        for r in rows:
            for i, cell in enumerate(r):
                widths[i] = max(widths[i], cell_len(_plain_text(cell)))
    else:
        rows = [[_text(c) for c in r] for r in rows]
        widths = [max([len(c.name)] + [r[i].cell_len for r in rows]) for i, c in enumerate(cols)]
    styles = list(styles) if styles is not None else [None] * len(rows)
    index = {c.name: i for i, c in enumerate(cols)}

    def total(idx):
        return sum(widths[i] for i in idx) + GAP * (len(idx) - 1)

    if columns is not None:
        shown = [index[n] for n in columns]
        if 0 not in shown:
            shown.insert(0, 0)
        chosen = True
    else:
        shown = list(range(len(cols)))
        chosen = wide
    width = console.width
    dropped, shortened = [], False
    if not is_plain and not chosen:
        # Drop the least important columns (the rightmost first among equals) until the table fits; a path
        # column is shortened from the middle (to PATH_FLOOR at least) before a column of priority 1 goes, and
        # to whatever room is left when the essential columns alone do not fit.
        paths = [i for i in shown if cols[i].shorten]
        full_rows = [list(r) for r in rows]

        def shorten(floor):
            nonlocal shortened
            if not paths or total(shown) <= width:
                return
            others = sum(widths[i] for i in shown if i not in paths) + GAP * (len(shown) - 1)
            budget = (width - others) // len(paths)
            if budget < min(floor, *(widths[i] for i in paths)):
                return
            for i in paths:
                texts = shorten_paths([r[i].plain for r in rows], budget)
                for r, t in zip(rows, texts):
                    if t != r[i].plain:
                        r[i] = Text(t, style=r[i].style)
                        shortened = True
                widths[i] = max([len(cols[i].name)] + [r[i].cell_len for r in rows])

        order = sorted((i for i in shown if cols[i].priority > 0), key=lambda i: (-cols[i].priority, -i))
        for i in order:
            if total(shown) <= width:
                break
            if cols[i].priority <= 1:
                shorten(PATH_FLOOR)
                if total(shown) <= width:
                    break
            shown.remove(i)
            dropped.append(i)
        shorten(12)
    blocks = not is_plain and total(shown) > width
    if blocks and shortened:  # one record per block has room for whole paths
        rows, shortened = full_rows, False
    if title:
        console.print(_text(title), style="bold", soft_wrap=True)
    if blocks:
        _print_blocks(console, cols, rows, styles, shown)
    elif is_plain:
        _write_plain(console, cols, shown, widths, [[c.name for c in cols]] + rows)
    else:
        # Laid out here rather than by rich's Table, whose column widths differ between rich releases (13.0
        # widened and then cropped a table measured to fit): each cell padded to its measured width.
        header = [Text(cols[i].name, style="bold") for i in shown]
        for cells, style in [(header, None)] + [([r[i] for i in shown], st) for r, st in zip(rows, styles)]:
            console.print(_line(cols, shown, widths, cells, style), soft_wrap=True, crop=False)
    if dropped:
        names = " ".join(cols[i].name for i in sorted(dropped))
        print_items(console, f"[dim]not shown to fit {width} columns: {_escape(names)} ({hint})[/]")
    if shortened and not blocks:
        names = " ".join(cols[i].name for i in shown if cols[i].shorten)
        print_items(console, f"[dim]{_escape(names)}: {ELLIPSIS} marks a path's middle, left out to fit "
                             f"({whole} for whole paths)[/]")
    if legend:
        helps = {}  # help text -> the shown columns it explains ("clip< clip>: values below/above ...")
        for i in shown:
            if cols[i].help:
                helps.setdefault(cols[i].help, []).append(cols[i].name)
        if helps:
            print_items(console, "; ".join(_escape(f"{' '.join(names)}: {h}") for h, names in helps.items()),
                        style="dim")
    return [cols[i].name for i in shown]


def _escape(text):
    from rich.markup import escape

    return escape(text)


def _line(cols, shown, widths, cells, style):
    """One table row: cells padded to their column's width and justified, GAP spaces apart, no trailing space."""
    from rich.text import Text

    line = Text()
    for k, (i, cell) in enumerate(zip(shown, cells)):
        pad = widths[i] - cell.cell_len
        left = {"right": pad, "center": pad // 2}.get(cols[i].justify, 0)
        if k:
            line.append(" " * GAP)
        line.append(" " * left)
        line.append_text(cell)
        if k < len(shown) - 1:
            line.append(" " * (pad - left))
    if style:
        line.stylize(style)
    return line


def _plain_text(cell):
    """A cell's text: a string as it is, a rich Text's plain text, "" for None."""
    if type(cell) is str:
        return cell
    return "" if cell is None else getattr(cell, "plain", None) or str(cell)


def _write_plain(console, cols, shown, widths, rows):
    """The lines :func:`_line` gives, as plain text written straight to the console's file in large blocks:
    rich takes ~0.15 ms a line, and an inspect of 20,000 groups prints 80,000 lines.  Cells are turned into
    text line by line (a copy of every row as text was a tenth of a large listing's memory)."""
    from rich.cells import cell_len

    last = shown[-1]
    lines = []
    for cells in rows:
        parts = []
        for i in shown:
            text = _plain_text(cells[i])
            pad = widths[i] - cell_len(text)
            justify = cols[i].justify
            left = pad if justify == "right" else pad // 2 if justify == "center" else 0
            parts.append(" " * left + text + (" " * (pad - left) if i != last else ""))
        lines.append((" " * GAP).join(parts))
        if len(lines) >= 4096:
            console.file.write("\n".join(lines) + "\n")
            lines.clear()
    if lines:
        console.file.write("\n".join(lines) + "\n")


def _print_blocks(console, cols, rows, styles, shown):
    """One record per block: the label on its own line, then ``name  value`` lines, a blank line between."""
    from rich.text import Text

    label_width = max(len(cols[i].name) for i in shown[1:]) if len(shown) > 1 else 0
    for n, (r, style) in enumerate(zip(rows, styles)):
        if n:
            console.print()
        head = (Text(f"{cols[shown[0]].name} ") if cols[shown[0]].prefix else Text()) + r[shown[0]]
        console.print(head, style=style or "bold", soft_wrap=True)
        for i in shown[1:]:  # a long value wrapped between its items, under its own first character
            name = f"  {cols[i].name.ljust(label_width)}  "
            print_items(console, Text(name) + r[i], style=style, indent=len(name))


def print_lines(console, lines, *, indent=0):
    """:func:`print_items` of each of ``lines`` (plain text, not markup), the same bytes; off a terminal written
    straight to the console's file in large blocks, as :func:`_write_plain` writes a table: a rich line costs
    ~0.1 ms, and an inspect of 20,000 groups prints a line per group.  Lines with a tab (which rich expands)
    go through rich."""
    if not plain(console) or console.record or any("\t" in text for text in lines):
        for text in lines:
            print_items(console, text, markup=False, indent=indent)
        return
    for start in range(0, len(lines), 4096):
        console.file.write("".join(text + "\n" for text in lines[start:start + 4096]))


def print_items(console, text, *, style=None, markup=True, soft_wrap=None, indent=0):
    """A long line: full length off a terminal; on a terminal wrapped only between items (``; `` and ``, ``
    separated parts stay whole where they fit), never inside a number or a name, the lines after the first
    ``indent`` spaces in.  ``text`` is rich markup (file strings in it escaped with
    :func:`qgcli.report.text.markup`) unless ``markup=False``, or a rich Text; ``soft_wrap`` is accepted for
    ``console.print`` compatibility and ignored."""
    from rich.text import Text

    line = text.copy() if isinstance(text, Text) else Text.from_markup(text) if markup else Text(text)
    if style:
        line.stylize(style)
    if plain(console) or line.cell_len <= console.width:
        console.print(line, soft_wrap=True)
        return
    width = console.width - indent  # every line but the first has the indent before it
    plain_text = line.plain
    # Break points outside brackets ("[4, 8, 8, 16]", "(ch 3 59.0%, ...)" stay whole): after two spaces,
    # then within a part too long for a line after "; ", then ", ", then any space, then after ", " inside
    # brackets; a word longer than a line goes whole (the terminal wraps it, nothing is cut).
    depth, breaks = 0, {"  ": [], "; ": [], ", ": [], " ": [], "(, ": []}
    for k, c in enumerate(plain_text):
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth = max(0, depth - 1)
        elif c == " " and depth == 0:
            breaks[" "].append(k + 1)
            if k and plain_text[k - 1] in ";, ":
                breaks[plain_text[k - 1] + " "].append(k + 1)
        elif c == " " and k and plain_text[k - 1] == ",":
            breaks["(, "].append(k + 1)
    # two spaces part a heading from its list; last, ", " inside brackets, for a bracketed list longer than a line
    seps = ("  ", "; ", ", ", " ", "(, ")

    def split(a, b, level):  # the parts of [a, b) at seps[level], the parts too long split at the next level
        ends = [k for k in breaks[seps[level]] if a < k < b] + [b]
        parts = []
        for lo, hi in zip([a] + ends[:-1], ends):
            if len(plain_text[lo:hi].rstrip()) > width and level + 1 < len(seps):
                parts.extend(split(lo, hi, level + 1))
            else:
                parts.append((lo, hi))
        return parts

    pieces = split(0, len(plain_text), 0)
    out, cur = [], None
    for a, b in pieces:
        if cur is None:
            cur = [a, b]
        elif len(plain_text[cur[0]:b].rstrip()) <= width + (0 if out else indent):
            cur[1] = b
        else:
            out.append(cur)
            cur = [a, b]
    if cur is not None:
        out.append(cur)
    for k, (a, b) in enumerate(out):
        part = line[a:b]
        part.rstrip()
        console.print(Text(" " * indent) + part if k and indent else part, soft_wrap=True)
