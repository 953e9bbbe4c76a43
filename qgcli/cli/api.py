"""``qgcli.run``: any command, from Python, exactly as the command line runs it.

The command's own options parse the arguments (the same defaults, the same checks), the same library code runs,
and the result is the document ``--json`` prints, as Python objects.  Errors are :class:`qgcli.errors.QgcliError`
(bad input, bad options: :class:`~qgcli.errors.UsageProblem` / :class:`~qgcli.errors.OptionError`) or
:class:`~qgcli.errors.RuntimeFailure`; click stays inside this package.

>>> import numpy as np, qgcli
>>> x = np.array([-7.0, -6.0, -1.0, 1.0, 6.0], np.float32)
>>> np.savez("bundle.npz", inputs=x, gradients=np.ones_like(x), min=np.float32(-6), max=np.float32(6))
>>> summary = qgcli.run("fakequant-grad", "bundle.npz", num_bits=2, output="grads.npz")
>>> summary["grid"]["nudged_min"], summary["grid"]["nudged_max"], summary["statistics"]["clipped_above"]
(-8.0, 4.0, 0.2)
>>> np.load("grads.npz")["backprops_wrt_input"].tolist()
[1.0, 1.0, 1.0, 1.0, 0.0]
>>> qgcli.run("fakequant-grad", "bundle.npz", axis=3, output="grads2.npz")
Traceback (most recent call last):
...
qgcli.errors.OptionError: Invalid value for '--axis': only applies to --variant per-channel
"""
import click

from qgcli.errors import OptionError, RuntimeFailure, UsageProblem


def run(command, *arguments, **options):
    """Run the qgcli ``command`` (``"fakequant-grad"``, ``"plot ste"``, ...) on ``arguments`` (its positional
    arguments: a bundle or run file, as on the command line) and ``options``, and return its ``--json`` document.

    Options are the command's long options in snake_case: ``num_bits=2`` is ``--num-bits 2``, ``min=-6`` is
    ``--min -6``, ``output="out.h5"`` is ``-o out.h5``; ``True`` gives a flag (``force=True``), ``False`` its
    ``--no-`` form where there is one; a list or tuple is joined with commas (``min=[-1, -2]``); ``None`` is left
    out.  Nothing is printed on stderr unless the command warns.
    """
    from qgcli.cli.app import main
    from qgcli.report.summaries import CAPTURED

    words = command.split()
    ctx = click.Context(main, info_name="qgcli")
    target = main
    for word in words:
        target = target.get_command(ctx, word) if isinstance(target, click.Group) else None
        if target is None:
            raise UsageProblem(f"no qgcli command {command!r}; choose from {', '.join(main.list_commands(ctx))}")
    argv = words + [str(a) for a in arguments] + _option_words(target, options)
    if any(p.name == "as_json" for p in target.params):
        argv.append("--json")
    captured = []
    token = CAPTURED.set(captured)
    try:
        main.main(argv, prog_name="qgcli", standalone_mode=False)
    except click.BadParameter as exc:
        hint = exc.param_hint or (exc.param.get_error_hint(exc.ctx) if exc.param is not None else None)
        raise OptionError(exc.message, param_hint=hint) from None
    except click.UsageError as exc:
        raise UsageProblem(exc.format_message()) from None
    except click.ClickException as exc:
        raise RuntimeFailure(exc.format_message()) from None
    finally:
        CAPTURED.reset(token)
    return captured[-1] if captured else None


def _option_words(command, options):
    """``--name value`` words for ``options``, checked against ``command``'s own options."""
    by_name = {}
    for param in command.params:
        for opt in param.opts + param.secondary_opts:
            if opt.startswith("--"):
                by_name.setdefault(opt[2:].replace("-", "_"), param)
    words = []
    for key, value in options.items():
        param = by_name.get(key)
        if param is None or not isinstance(param, click.Option) or param.name == "as_json":
            known = sorted({o[2:].replace("-", "_") for p in command.params if isinstance(p, click.Option)
                            for o in p.opts if o.startswith("--") and p.name != "as_json"})
            raise OptionError(f"not an option of 'qgcli {command.name}'; it takes {', '.join(known)}",
                              param_hint=repr(key))
        long = next(o for o in param.opts if o.startswith("--"))
        if value is None:
            continue
        if param.is_flag and isinstance(value, bool):
            if value:
                words.append(long)
            elif param.secondary_opts:
                words.append(param.secondary_opts[0])
            continue
        if isinstance(value, (list, tuple)):
            value = ",".join(str(v) for v in value)
        words += [long, str(value)]
    return words
