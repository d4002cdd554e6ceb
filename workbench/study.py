"""
Studies as files: which runs a comparison trains, read from a TOML file (or built from `compare --residual`).

    python cli.py compare --study studies/depth.toml --out runs/depth

The study file's format, where its runs live, and what is refused: docs/usage.md, "Studies and study files".
"""
import difflib
import json
import re
import tomllib
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Optional

from delta_gpt import RESIDUALS, ROUTING_FIELDS
from errors import DeltaGPTError
import train as T
from plumbing import config as O
from plumbing.rundir import check_folder

STUDY_KEYS = ("seeds", "reference", "preset", "train", "sweep", "variants", "pairs")
ROUTING_ONLY = ROUTING_FIELDS + ("route_lr_mult",)  # no use to a baseline
SET_BY_COMPARE = ("seed", "out_dir", "resume", "overwrite")  # every run's own
EVERY_SUBLAYER = "S"  # n_route_blocks = "S": N = 2 * n_layer
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]*")


class StudyError(DeltaGPTError):
    """A study file or study folder that cannot be used."""


@dataclass
class Study:
    name: str
    seeds: list
    reference: str
    preset: Optional[str]
    train: dict                     # options of every run (command-line options already on top)
    sweep: Optional[tuple]          # (option, [values]) or None
    variants: dict                  # name -> {"residual": mode, option: value, ...}
    pairs: list = field(default_factory=list)  # [[a, b], ...]: a's paired difference to b, beside the reference's

    def definition(self):
        """What identifies the study (study.json): everything but its name."""
        return dict(seeds=self.seeds, reference=self.reference, preset=self.preset, train=self.train,
                    sweep=None if self.sweep is None else {self.sweep[0]: self.sweep[1]}, variants=self.variants,
                    pairs=self.pairs)


@dataclass
class Run:
    variant: str
    value: object                   # the sweep value (None without a sweep)
    seed: int
    cfg: object                     # out_dir set: runs of a variant the sweep does not apply to share one
    swept: bool = True              # False: the sweep does not apply to the variant (a baseline's block count)


def load_study(path, overrides=None, preset=None):
    """The Study in a TOML file, with command-line train options `overrides` on top of its [train]."""
    path = Path(path)
    if not path.is_file():
        said = "is a folder" if path.is_dir() else "does not exist"
        raise StudyError(f"study file {path} {said}; give a TOML file such as studies/depth.toml")
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise StudyError(f"{path} is not valid TOML: {e}; fix the file") from None
    except UnicodeDecodeError:
        raise StudyError(f"{path} is not UTF-8 text; save it as UTF-8") from None
    return study_from_dict(raw, path.stem, overrides, preset, where=str(path))


def study_from_modes(modes, seeds, preset=None, overrides=None):
    """The study `compare --residual a,b,c` asks for: one variant per mode, paired with the baseline
    (or the first mode when the baseline is not among them)."""
    reference = "baseline" if "baseline" in modes else (modes[0] if modes else "baseline")
    variants = {}
    for m in modes or [""]:  # delta, delta-static, delta_block-h4: the names bench and study files use
        try:
            residual, named = O.parse_mode(m)
        except DeltaGPTError as e:
            raise StudyError(str(e)) from None
        variants[m] = {"residual": residual, **named}
    return study_from_dict(dict(seeds=list(seeds), reference=reference, variants=variants), "compare", overrides,
                           preset, where="compare")


def study_from_dict(raw, name, overrides=None, preset=None, where="the study"):
    """Check a study's parts (one StudyError naming the first problem) and return the Study."""
    unknown = [k for k in raw if k not in STUDY_KEYS]
    if unknown:
        raise StudyError(f"{where}: unknown key {unknown[0]!r}; a study has {', '.join(STUDY_KEYS)}")
    seeds = raw.get("seeds", [1, 2, 3])
    if (not isinstance(seeds, list) or not seeds or not all(type(s) is int for s in seeds)
            or len(set(seeds)) < len(seeds)):
        raise StudyError(f"{where}: seeds must be a list of distinct integers, got {seeds!r}")
    variants = raw.get("variants")
    if not isinstance(variants, dict) or not variants:
        raise StudyError(f"{where} has no [variants]; add at least one, e.g. [variants.baseline] with "
                         f"residual = \"baseline\"")
    train = checked_options(raw.get("train", {}), f"{where} [train]")
    if "residual" in train:
        raise StudyError(f"{where} [train] sets residual; each variant sets its own mode")
    sweep = checked_sweep(raw.get("sweep"), where, train)
    cli = checked_options(overrides or {}, "the command line", flag=True)
    if sweep and sweep[0] in cli:
        raise StudyError(f"--{O.flag(sweep[0])} is swept by {where}; leave it out (the command line overrides "
                         f"[train] only)")
    checked = {}
    for vname, options in variants.items():
        checked[vname] = checked_variant(vname, options, where, sweep)
    folders = {}
    for vname in checked:
        other = folders.setdefault(vname.lower(), vname)
        if other != vname:
            raise StudyError(f"{where}: variants {other!r} and {vname!r} differ only in case and would share one "
                             f"run folder on many disks; rename one")
    reference = raw.get("reference", "baseline")
    if reference not in checked:
        raise StudyError(f"{where}: reference {reference!r} is not a variant; choose one of {', '.join(checked)}")
    pairs = raw.get("pairs", [])
    if not isinstance(pairs, list) or not all(isinstance(p, list) and len(p) == 2 and all(isinstance(v, str) for v in p)
                                              for p in pairs):
        raise StudyError(f'{where}: pairs must be a list of two-variant lists such as [["delta-static", "delta"]], '
                         f"got {pairs!r}")
    for a, b in pairs:
        unknown = next((v for v in (a, b) if v not in checked), None)
        if unknown is not None or a == b:
            raise StudyError(f"{where}: pairs [{a!r}, {b!r}] " + (f"names {unknown!r}, which is not a variant; choose "
                             f"from {', '.join(checked)}" if unknown is not None else "pairs a variant with itself"))
    preset = preset or raw.get("preset")
    if preset is not None and preset not in T.PRESETS:
        raise StudyError(f"{where}: unknown preset {preset!r}; choose one of {', '.join(T.PRESETS)}")
    return Study(name, seeds, reference, preset, {**train, **cli}, sweep, checked, pairs)


def checked_options(options, where, flag=False):
    """options with each name a TrainConfig field and each value of its type (ints taken for floats)."""
    if not isinstance(options, dict):
        raise StudyError(f"{where} must be a table of options")
    kinds = {f.name: str(f.type) for f in fields(T.TrainConfig)}
    out = {}
    for key, value in options.items():
        shown = f"--{O.flag(key)}" if flag else key
        if key not in kinds or key == "preset":
            close = difflib.get_close_matches(key, [k for k in kinds if k != "preset"], n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            raise StudyError(f"{where}: unknown option {key!r}{hint}")
        if key in SET_BY_COMPARE:
            raise StudyError(f"{where}: compare sets {shown} of each run itself; leave it out")
        out[key] = checked_value(key, kinds[key], value, where)
    return out


def checked_value(key, kind, value, where):
    if key == "n_route_blocks" and value == EVERY_SUBLAYER:
        return value
    try:
        return O.typed(kind, value, text=False)  # None: from the command line's --option none
    except ValueError as expected:
        extra = f' or "{EVERY_SUBLAYER}" (every sublayer)' if key == "n_route_blocks" else ""
        raise StudyError(f"{where}: {key} expects {expected}{extra}, got {value!r}") from None


def checked_sweep(sweep, where, train):
    """(option, values) of a [sweep] table of exactly one option, or None."""
    if sweep is None:
        return None
    if not isinstance(sweep, dict) or len(sweep) != 1:
        names = ", ".join(sweep) if isinstance(sweep, dict) else repr(sweep)
        raise StudyError(f"{where}: [sweep] must hold exactly one option (it has {names or 'none'}); "
                         f"sweep one option per study")
    (key, values), = sweep.items()
    if not isinstance(values, list) or not values:
        raise StudyError(f"{where} [sweep]: {key} must be a list of values, got {values!r}")
    values = [checked_options({key: v}, f"{where} [sweep]")[key] for v in values]
    if key == "residual":
        raise StudyError(f"{where} [sweep]: residual is each variant's own mode; make a variant per mode instead")
    if key in train:
        raise StudyError(f"{where}: {key} is both swept and set in [train]; set it in one place")
    labels = [value_label(v) for v in values]
    dup = next((l for l in labels if labels.count(l) > 1), None)
    if dup is not None:
        raise StudyError(f"{where} [sweep]: {key}={dup} is listed twice; list each value once")
    return key, values


def checked_variant(vname, options, where, sweep):
    if not isinstance(vname, str) or not NAME.fullmatch(vname):
        raise StudyError(f"{where}: variant name {vname!r} must be letters, digits, '.', '_', '+' or '-' (it names "
                         f"a folder)")
    if not isinstance(options, dict):
        raise StudyError(f"{where}: variant {vname!r} must be a table, e.g. [variants.{vname}] residual = \"delta\"")
    mode = options.get("residual")
    if mode not in RESIDUALS:
        said = "sets no residual" if mode is None else f"has unknown mode {mode!r}"
        raise StudyError(f"{where}: variant {vname!r} {said}; set residual to one of {', '.join(RESIDUALS)}")
    options = checked_options(options, f"{where}: variant {vname!r}")
    if sweep and sweep[0] in options:
        raise StudyError(f"{where}: variant {vname!r} sets {sweep[0]}, which [sweep] sweeps; drop one of the two")
    return options


def value_label(value):
    return str(value).lower() if isinstance(value, bool) else str(value)


def sweep_applies(study, variant):
    return study.sweep is not None and not (study.variants[variant]["residual"] == "baseline"
                                            and study.sweep[0] in ROUTING_ONLY)


def run_settings(cfg):
    """The settings that decide a run's numbers, with the model's defaults filled in as the run records them."""
    return {k: v for k, v in asdict(O.with_model_defaults(cfg)).items() if k not in O.BOOKKEEPING_FIELDS}


def cross(study, out):
    """Every Run of the study (sweep value x variant x seed), its TrainConfig built and checked; runs of
    a variant the sweep does not apply to appear at every value with one out_dir. Refuses two variants that
    would train the same model with the same settings."""
    out = Path(out)
    runs, seen = [], {}
    for value in (study.sweep[1] if study.sweep else [None]):
        for vname, options in study.variants.items():
            swept = sweep_applies(study, vname)
            base = {k: v for k, v in study.train.items() if options["residual"] != "baseline" or k not in ROUTING_ONLY}
            kw = {**base, **options, **({study.sweep[0]: value} if swept else {})}
            if kw.get("n_route_blocks") == EVERY_SUBLAYER:
                kw["n_route_blocks"] = 2 * kw.get("n_layer", T.make_config(study.preset).n_layer)
            folder = out / f"{study.sweep[0]}={value_label(value)}" if swept else out
            at = f" at {study.sweep[0]}={value_label(value)}" if swept else ""
            for seed in study.seeds:
                try:
                    cfg = T.make_config(study.preset, **kw, seed=seed, out_dir=str(folder / f"{vname}-s{seed}"))
                except DeltaGPTError as e:
                    raise StudyError(f"variant {vname!r}{at}: {e}") from None
                runs.append(Run(vname, value, seed, cfg, swept))
            key = json.dumps({k: v for k, v in run_settings(cfg).items() if k != "seed"}, sort_keys=True, default=str)
            other = seen.setdefault((value_label(value), key), vname)
            if other != vname:
                raise StudyError(f"variants {other!r} and {vname!r} train the same model with the same settings{at}; "
                                 f"remove one or make them differ")
    return runs


def claim_folder(study, out, overwrite=False, write=True):
    """Check that OUT holds no runs of another study and no files a compare did not write (with --overwrite it
    is taken over), then (with write) record this one in OUT/study.json. More seeds, sweep values or variants
    extend a study; a folder without study.json but with compare.json (an older compare) is adopted: its runs'
    settings are checked one by one when reused."""
    out = Path(out)
    path = out / "study.json"
    mine = json.loads(json.dumps(study.definition()))  # as it reads back
    check_folder(out, "--out")
    theirs = sorted(p.name for p in out.iterdir()) if out.is_dir() and not path.exists() else []
    if theirs and "compare.json" not in theirs and not overwrite:  # not a study's, nor an older compare's
        shown = ", ".join(theirs[:3]) + (", ..." if len(theirs) > 3 else "")
        raise StudyError(f"{out} holds files that no compare wrote ({shown}); choose another --out, or pass "
                         f"--overwrite to use it (compare.md, compare.json and the pictures there are replaced)")
    if path.exists() and not overwrite:
        try:
            theirs = json.loads(path.read_text())["study"]
            diff = conflicts(theirs, mine)
        except (ValueError, KeyError, TypeError, AttributeError):
            raise StudyError(f"{path} is unreadable; move it away if {out} holds no study's runs, or choose "
                             f"another --out") from None
        if diff:
            raise StudyError(f"{out} holds the runs of another study (it differs in "
                             + "; ".join(f"{k} ({json.dumps(a)} there, {json.dumps(b)} here)" for k, a, b in diff)
                             + "); choose another --out, or pass --overwrite to train this study there afresh")
    if not write:
        return
    out.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(dict(name=study.name, study=mine), indent=2) + "\n")
    tmp.replace(path)


def conflicts(theirs, mine):
    """Where two study definitions differ in what makes their runs one study: the preset, [train], the
    reference, the swept option and the options of each variant both have (seeds, sweep values and variants
    may be added or dropped)."""
    shared = set(theirs["variants"]) & set(mine["variants"])

    def parts(d):
        train = {k: v for k, v in d["train"].items() if k not in O.BOOKKEEPING_FIELDS}  # --threads 1 is no other study
        return dict(preset=d["preset"], train=train, reference=d["reference"], sweep=list(d["sweep"] or {}),
                    variants={k: v for k, v in d["variants"].items() if k in shared})
    return differences(parts(theirs), parts(mine))


def differences(a, b, prefix=""):
    """[(dotted key, a's value, b's value)] where two nested dicts differ."""
    if not (isinstance(a, dict) and isinstance(b, dict)):
        return [] if a == b else [(prefix, a, b)]
    return [d for k in dict.fromkeys([*a, *b]) for d in differences(a.get(k), b.get(k), f"{prefix}{k}" if not prefix
                                                                      else f"{prefix}.{k}")]
