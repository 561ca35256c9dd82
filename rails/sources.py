"""Public labelled sources of the moderation probes: the manifest, the readers, one taxonomy.

Every row the shipped probes were fitted on comes from a public repository pinned here by commit, path and
sha256 (``SOURCES``); ``rails/data/SOURCES.md`` is the same manifest as a table, with the rows each source gave
(``python -m tools.write_sources_md``, run after a fit). Third-party text is never committed: a user (or
``flashguard calibrate --sources``) gets the files either from a folder they name, laid out as
``FOLDER/<owner>/<name>/<path>``, or downloaded into the user cache from the pinned commit, and every file is checked
against its sha256 before a row is read (``locate``).

Contract:

- ``rows(source, rail)`` -> ``list[Row]``, deterministic: a source's rows are ordered by the sha256 of their text
  and cut at ``source.cap`` (so a capped sample does not depend on the file's order), labels mapped to one taxonomy
  (``HARM`` for blocked rows, ``BENIGN`` for allowed ones); an unreadable file is a ``SourceError`` naming it.
- ``Row.source`` names the source: leave-one-source-out validation (``rails/guard_fit.py``) groups by it.
- A source whose license does not allow training (``train=False``) is read for evaluation only.
- ``Row.context`` holds a multi-turn row's earlier turns (``(("user", text), ("assistant", text), ...)``) before
  ``Row.user``; it is empty for a single message or exchange.
"""

from __future__ import annotations

import csv
import gzip
import hashlib
import io
import json
import os
import re
import urllib.request
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from flashguard.errors import FlashguardError

# one taxonomy for every source (a blocked row's category); benign rows keep what kind of text they are
HARM = ("violence", "weapons", "self_harm", "hate", "harassment", "sexual", "minors", "crime", "cyber", "drugs",
        "privacy", "misinformation", "jailbreak", "general_harm")
BENIGN = ("everyday", "code", "math", "medical", "refusal", "security", "statement", "social_post")
RAW_URL = "https://raw.githubusercontent.com/{repo}/{commit}/{path}"


class SourceError(FlashguardError):
    """A source file is missing, fails its sha256, or cannot be parsed."""


@dataclass(frozen=True)
class File:
    repo: str      # owner/name on GitHub
    commit: str
    path: str
    sha256: str


@dataclass(frozen=True)
class Row:
    user: str
    bot: Optional[str]   # None: an input-rail row (the user's message alone)
    block: bool
    category: str
    source: str
    context: tuple = ()  # earlier turns before ``user``: ((role, text), ...), role "user" or "assistant"


@dataclass(frozen=True)
class Source:
    name: str
    files: tuple[File, ...]
    license: str
    rails: tuple[str, ...]          # "input", "output"
    mapping: str                    # the source's labels -> ours, in words (SOURCES.md)
    reader: Callable[["Source", list[bytes], str], list[Row]]
    cap: int = 600                  # rows a rail uses at most
    train: bool = True              # False: evaluation only (license)


# ---------------------------------------------------------------------------------------------------- readers

def _clip(text: str, limit: int = 1500) -> str:
    """A long reply or message cut at ``limit`` characters (at a space where there is one): the rail judges replies
    in chunks as they stream, and the calibration's prefill stays bounded."""
    text = text.strip()
    if len(text) <= limit:
        return text
    cut = text.rfind(" ", 0, limit)
    return text[:cut if cut > limit // 2 else limit]


def _lines(data: bytes) -> list[str]:
    return [x.strip() for x in data.decode("utf-8").splitlines() if x.strip()]


def _csv(data: bytes) -> list[dict]:
    return list(csv.DictReader(io.StringIO(data.decode("utf-8-sig"))))


def _read_lines(category: str):
    def read(src, blobs, rail):
        return [Row(x, None, True, category, src.name) for b in blobs for x in _lines(b)]
    return read


def _read_custom_behaviors(src, blobs, rail):
    return [Row(r["goal"].strip(), None, True, "general_harm", src.name) for r in _csv(blobs[0]) if r["goal"].strip()]


HARMBENCH = {"chemical_biological": "weapons", "illegal": "crime", "misinformation_disinformation": "misinformation",
             "harmful": "violence", "harassment_bullying": "harassment", "cybercrime_intrusion": "cyber"}


def _read_harmbench(src, blobs, rail):
    out = []
    for r in _csv(blobs[0]):
        if r["FunctionalCategory"] != "standard":   # copyright (not harm) and contextual (a pasted context) left out
            continue
        out.append(Row(r["Behavior"].strip(), None, True, HARMBENCH[r["SemanticCategory"]], src.name))
    return out


STRONGREJECT = {"Disinformation and deception": "misinformation", "Hate, harassment and discrimination": "hate",
                "Illegal goods and services": "crime", "Non-violent crimes": "crime", "Sexual content": "sexual",
                "Violence": "violence"}


def _read_strongreject(src, blobs, rail):
    return [Row(r["forbidden_prompt"].strip(), None, True, STRONGREJECT[r["category"]], src.name)
            for r in _csv(blobs[0])]


AILUMINATE = {"vcr": "violence", "src": "sexual", "cse": "minors", "ssh": "self_harm", "iwp": "weapons",
              "ncr": "crime", "hte": "hate", "prv": "privacy", "sxc_prn": "sexual"}


def _read_ailuminate(src, blobs, rail):
    # dfm (defamation), ipv (intellectual property) and spc_* (specialized advice: a medical or legal question) are
    # left out: whether they are harm depends on facts a guard cannot see, and medical questions must pass
    return [Row(_clip(r["prompt_text"]), None, True, AILUMINATE[r["hazard"]], src.name)
            for r in _csv(blobs[0]) if r["hazard"] in AILUMINATE]


SST = {"Suicide, Self-Harm, and Eating Disorders": "self_harm", "Physical harm and Violence": "violence",
       "Illegal and Highly Regulated items": "crime", "Scams and fraud": "crime", "Child safety": "minors"}


def _read_sst(src, blobs, rail):
    return [Row(r["prompts_final"].strip(), None, True, SST[r["harm_area"]], src.name) for r in _csv(blobs[0])]


JBB = {"Harassment/Discrimination": "harassment", "Malware/Hacking": "cyber", "Physical harm": "violence",
       "Economic harm": "crime", "Fraud/Deception": "crime", "Disinformation": "misinformation",
       "Sexual/Adult content": "sexual", "Privacy": "privacy", "Expert advice": "general_harm",
       "Government decision-making": "general_harm"}


JBB_ATTACKS = {"PAIR": "pair", "JBC": "jbc", "prompt_with_random_search": "random_search", "GCG": "gcg"}


def _read_jbb(src, blobs, rail):
    """Input: every attack prompt is an attack (blocked, ``jailbreak``). Output: a response the benchmark's judge
    marked jailbroken is a harmful reply (the goal's category); one it did not is allowed (``refusal``: the models
    refused or answered beside the point). Each attack method is a source of its own for validation
    (``jailbreakbench_pair``, ``_jbc``, ``_random_search``, ``_gcg``): a different generator wrote its prompts and
    drew its target models' replies (the 100 goals are shared: an output row's user message recurs across them)."""
    out = []
    for f, b in zip(src.files, blobs):
        name = f"{src.name}_{JBB_ATTACKS[f.path.split('/')[1]]}"
        for j in json.loads(b)["jailbreaks"]:
            if rail == "input":
                if j.get("prompt"):
                    out.append(Row(_clip(j["prompt"]), None, True, "jailbreak", name))
            elif j.get("response"):
                out.append(Row(j["goal"].strip(), _clip(j["response"]), bool(j["jailbroken"]),
                               JBB[j["category"]] if j["jailbroken"] else "refusal", name))
    return out


def _read_injection(src, blobs, rail):
    return [Row(_clip(r["user_input"]), None, True, "jailbreak", src.name) for r in json.loads(blobs[0])
            if r.get("injection_type") == "direct" and r.get("speaking_language", "English") == "English"]


def _read_frr(src, blobs, rail):
    return [Row(_clip(r["mutated_prompt"]), None, False, "security", src.name) for r in json.loads(blobs[0])
            if r.get("is_malicious") is False]


def _read_toxigen(src, blobs, rail):
    """``hate_*`` files: hateful statements about a group (blocked, ``hate``); ``neutral_*``: neutral or kind
    statements about the same groups (allowed, ``statement``). Each line of a file is a generation prompt listing
    several statements (``- a\\n- b ...``, the separator written out): every statement is a row. As a reply (output
    rail) the user asked the model about the group."""
    out = []
    for f, b in zip(src.files, blobs):
        hate = Path(f.path).name.startswith("hate_")
        group = Path(f.path).stem.split("_", 1)[1].replace("_1k", "").replace("_", " ")
        for text in (t.strip(" -") for line in _lines(b) for t in line.split("\\n")):
            if len(text) < 12:
                continue
            if rail == "input":
                out.append(Row(text, None, hate, "hate" if hate else "statement", src.name))
            else:
                out.append(Row(f"What do you think about {group} people?", text, hate,
                               "hate" if hate else "statement", src.name))
    return out


def _read_davidson(src, blobs, rail):
    """class 0 (hate speech) blocked as ``hate``, class 2 (neither) allowed as ``social_post``; class 1 (offensive
    language, not hate: mostly profanity in song lyrics and banter) left out as ambiguous."""
    out = []
    for r in _csv(blobs[0]):
        cls = r["class"]
        if cls not in ("0", "2"):
            continue
        text = re.sub(r"(@\w+:?|https?://\S+|&amp;|&#\d+;|\bRT\b)", " ", r["tweet"])
        text = re.sub(r"\s+", " ", text).strip(" !:")
        if len(text) < 12:
            continue
        block = cls == "0"
        category = "hate" if block else "social_post"
        out.append(Row(text, None, block, category, src.name) if rail == "input"
                   else Row("Write a short social media post.", text, block, category, src.name))
    return out


def _read_gsm8k(src, blobs, rail):
    out = []
    for line in _lines(blobs[0]):
        r = json.loads(line)
        answer = re.sub(r"<<[^>]*>>", "", r["answer"]).replace("####", "The answer is")
        out.append(Row(r["question"].strip(), None if rail == "input" else _clip(answer), False, "math", src.name))
    return out


def _instruction(instruction: str, given: str) -> str:
    return f"{instruction.strip()}\n\n{given.strip()}" if given and given.strip() else instruction.strip()


def _read_codealpaca(src, blobs, rail):
    return [Row(_instruction(r["instruction"], r.get("input", "")), None if rail == "input" else _clip(r["output"]),
                False, "code", src.name) for r in json.loads(blobs[0]) if r["output"].strip()]


def _read_self_instruct(src, blobs, rail):
    out = []
    for b in blobs:
        for line in _lines(b):
            r = json.loads(line)
            inst = r["instances"][0]
            if not inst.get("output", "").strip():
                continue
            out.append(Row(_instruction(r["instruction"], inst.get("input", "")),
                           None if rail == "input" else _clip(inst["output"]), False, "everyday", src.name))
    return out


def _read_humaneval(src, blobs, rail):
    out = []
    for line in _lines(gzip.decompress(blobs[0])):
        r = json.loads(line)
        user = "Complete this Python function:\n\n" + r["prompt"].strip()
        out.append(Row(_clip(user), None if rail == "input" else _clip(r["prompt"] + r["canonical_solution"]),
                       False, "code", src.name))
    return out


def _read_medquad(src, blobs, rail):
    out = []
    for b in blobs:
        root = ET.fromstring(b)
        for pair in root.iter("QAPair"):
            q, a = pair.findtext("Question") or "", pair.findtext("Answer") or ""
            if q.strip() and a.strip():
                out.append(Row(q.strip(), None if rail == "input" else _clip(a), False, "medical", src.name))
    return out


def _read_safe_responses(src, blobs, rail):
    return [Row(r["Behavior"].strip(), _clip(r["Safe_Response"]), False, "refusal", src.name)
            for r in _csv(blobs[0]) if r["Safe_Response"].strip()]


def _read_targets(src, blobs, rail):
    """HarmBench's optimizer targets ("Sure, here's how to ..."): the opening of a compliant reply to a harmful
    behavior, blocked (the reply is the start of help with harm). The user's message is the behavior."""
    behaviors = {r["BehaviorID"]: r for r in _csv(blobs[0]) if r["FunctionalCategory"] == "standard"}
    return [Row(behaviors[k]["Behavior"].strip(), t.strip(), True, HARMBENCH[behaviors[k]["SemanticCategory"]],
                src.name) for k, t in json.loads(blobs[1]).items() if k in behaviors]


_TURN = re.compile(r"\n\nHuman: |\n\nAssistant: ")
REFUSAL = re.compile(r"\b(I'm sorry|I am sorry|I can't|I cannot|I won't|I will not|I don't think (I|that|it)|"
                     r"not (appropriate|something I)|I'd rather not|I'm not (able|comfortable|going))", re.I)


def _read_hh(src, blobs, rail):
    """Red-team dialogues (the human's requests, the assistant's replies), used where the chosen last reply refuses:
    it is allowed (``refusal``), and the rejected one, where it does not refuse, is blocked (the worker preferred a
    refusal to it, so it helped with what was asked: ``general_harm``). A chosen reply that does not refuse is only
    the more harmless of two and is left out (many still help with the red-team request). A dialogue of several
    exchanges is one row: its earlier turns (the same in both) are the row's context."""
    out = []
    for line in _lines(gzip.decompress(blobs[0])):
        r = json.loads(line)
        chosen, rejected = _TURN.split(r["chosen"])[1:], _TURN.split(r["rejected"])[1:]
        if len(chosen) < 2 or len(chosen) % 2 or len(rejected) != len(chosen) or chosen[:-1] != rejected[:-1]:
            continue
        user, good, bad = chosen[-2].strip(), chosen[-1].strip(), rejected[-1].strip()
        if not user or not good or not bad or good == bad:
            continue
        if not REFUSAL.search(good):
            continue
        context = tuple(("user" if i % 2 == 0 else "assistant", _clip(t)) for i, t in enumerate(chosen[:-2]))
        out.append(Row(user, _clip(good), False, "refusal", src.name, context))
        if not REFUSAL.search(bad):
            out.append(Row(user, _clip(bad), True, "general_harm", src.name, context))
    return out


# ---------------------------------------------------------------------------------------------------- manifest



# filled from rails/data/source_files.json (repo, commit, path, sha256 of every file), kept apart from the code so
# that a long list of file hashes does not hide the readers
_FILES = json.loads((Path(__file__).resolve().parent / "data" / "source_files.json").read_text(encoding="utf-8"))


def _files(name: str) -> tuple[File, ...]:
    return tuple(File(**f) for f in _FILES[name])


SOURCES: tuple[Source, ...] = (
    Source("advbench", _files("advbench"), "MIT (AdvBench, llm-attacks; copied in Princeton-SysML/Jailbreak_LLM)",
           ("input",), "every line a harmful request: blocked, general_harm", _read_lines("general_harm"), cap=300),
    Source("malicious_instruct", _files("malicious_instruct"), "none stated", ("input",),
           "every line a harmful request: blocked, general_harm", _read_lines("general_harm"), train=False),
    Source("pair_custom_behaviors", _files("pair_custom_behaviors"), "MIT (JailbreakingLLMs)", ("input",),
           "goal column: blocked, general_harm", _read_custom_behaviors),
    Source("harmbench", _files("harmbench"), "MIT (HarmBench, copied in busycalibrating/AdversariaLLM)", ("input",),
           "standard behaviors (copyright and contextual left out): blocked; SemanticCategory -> ours", _read_harmbench),
    Source("strongreject", _files("strongreject"), "MIT (StrongREJECT, copied in busycalibrating/AdversariaLLM)",
           ("input",), "forbidden_prompt: blocked; category -> ours", _read_strongreject),
    Source("ailuminate", _files("ailuminate"), "CC-BY-4.0 (MLCommons AILuminate demo prompt set)", ("input",),
           "prompt_text: blocked; hazard -> ours (dfm, ipv, spc_* left out)", _read_ailuminate, cap=500),
    Source("simple_safety_tests", _files("simple_safety_tests"), "CC-BY-4.0", ("input",),
           "prompts_final: blocked; harm_area -> ours", _read_sst),
    Source("jailbreakbench", _files("jailbreakbench"), "MIT", ("input", "output"),
           "input: every attack prompt blocked (jailbreak); output: the goal and the target model's response, "
           "blocked when the benchmark's judge says jailbroken (the goal's category), else allowed (refusal)",
           _read_jbb, cap=700),
    Source("prompt_injection", _files("prompt_injection"), "MIT (CyberSecEval, meta-llama/PurpleLlama)", ("input",),
           "direct English injections (user_input): blocked, jailbreak", _read_injection, cap=150),
    Source("cyberseceval_frr", _files("cyberseceval_frr"), "MIT (CyberSecEval, meta-llama/PurpleLlama)", ("input",),
           "benign security requests that sound malicious (is_malicious false): allowed, security", _read_frr,
           cap=300),
    Source("toxigen", _files("toxigen"), "MIT / CDLA-Permissive-2.0 (microsoft/TOXIGEN)", ("input", "output"),
           "hate_* statements blocked (hate), neutral_* allowed (statement); as a reply to a question about the group",
           _read_toxigen, cap=600),
    Source("davidson", _files("davidson"), "MIT", ("input", "output"),
           "class 0 hate speech blocked (hate), class 2 neither allowed (social_post), class 1 offensive left out",
           _read_davidson, cap=500),
    Source("gsm8k", _files("gsm8k"), "MIT", ("input", "output"), "question (and answer): allowed, math", _read_gsm8k,
           cap=250),
    Source("codealpaca", _files("codealpaca"), "CC-BY-NC-4.0 (data)", ("input", "output"),
           "instruction + input (and output): allowed, code", _read_codealpaca, cap=200, train=False),
    Source("self_instruct", _files("self_instruct"), "Apache-2.0", ("input", "output"),
           "instruction + first instance (and its output): allowed, everyday", _read_self_instruct, cap=300),
    Source("humaneval", _files("humaneval"), "MIT", ("input", "output"),
           "function prompt (and canonical solution): allowed, code", _read_humaneval, cap=100),
    Source("medquad", _files("medquad"), "CC-BY-4.0", ("input", "output"),
           "question (and answer) pairs with an answer: allowed, medical", _read_medquad, cap=300),
    Source("harmbench_refusals", _files("harmbench_refusals"), "MIT (AdversariaLLM safe responses)", ("output",),
           "behavior and its safe response: allowed, refusal", _read_safe_responses),
    Source("harmbench_targets", _files("harmbench_targets"), "MIT (HarmBench)", ("output",),
           "standard behavior and its optimizer target (a compliant opening): blocked, behavior's category",
           _read_targets),
    Source("hh_rlhf", _files("hh_rlhf"), "MIT (anthropics/hh-rlhf)", ("output",),
           "red-team dialogues whose chosen last reply refuses: chosen allowed (refusal); rejected blocked where it "
           "does not refuse (general_harm); earlier exchanges as context", _read_hh, cap=900),
)
BY_NAME = {s.name: s for s in SOURCES}


# ---------------------------------------------------------------------------------------------------- locating

def sources_cache() -> Path:
    from flashguard.engine.loader import user_cache_dir

    return user_cache_dir() / "sources"


def locate(f: File, folder: Optional[Path] = None, download: bool = True) -> bytes:
    """The bytes of ``f``, checked against its sha256: from ``folder/<owner>/<name>/<path>`` when a folder is given
    (a user's copy), else from the user cache, downloading the pinned commit's file there once."""
    if folder is not None:
        path = Path(folder) / f.repo / f.path
        if not path.is_file():
            raise SourceError(f"{path}: missing (the sources folder holds each file as <owner>/<name>/<path>; "
                              f"{f.repo} at {f.commit[:12]})")
        return _checked(path.read_bytes(), f, str(path))
    path = sources_cache() / f.repo / f.commit / f.path
    if path.is_file():
        return _checked(path.read_bytes(), f, str(path))
    if not download:
        raise SourceError(f"{path}: not downloaded yet")
    url = RAW_URL.format(repo=f.repo, commit=f.commit, path=urllib.request.quote(f.path))
    try:
        with urllib.request.urlopen(url, timeout=60) as r:
            data = r.read()
    except OSError as exc:
        raise SourceError(f"{url}: {exc} (without a network, copy the files into a folder and pass "
                          f"--sources FOLDER)") from exc
    data = _checked(data, f, url)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".part")
    tmp.write_bytes(data)
    os.replace(tmp, path)
    return data


def _checked(data: bytes, f: File, where: str) -> bytes:
    got = hashlib.sha256(data).hexdigest()
    if got != f.sha256:
        raise SourceError(f"{where}: sha256 {got[:16]}... is not the manifest's {f.sha256[:16]}... for {f.repo} "
                          f"{f.path} at {f.commit[:12]} (another version of the file)")
    return data


def rows(source: Source, rail: str, folder: Optional[Path] = None, cap: Optional[int] = None) -> list[Row]:
    """``source``'s rows for ``rail`` ("input" or "output"), deterministic, at most ``cap`` (default the
    source's), duplicates of a text (the message, the reply and the earlier turns) dropped."""
    if rail not in source.rails:
        return []
    blobs = [locate(f, folder) for f in source.files]
    try:
        got = source.reader(source, blobs, rail)
    except (KeyError, ValueError, TypeError, ET.ParseError, json.JSONDecodeError) as exc:
        raise SourceError(f"{source.name}: cannot read {source.files[0].path}: {exc!r}") from exc
    seen, out = set(), []
    for r in sorted(got, key=_order):
        text = (r.user, r.bot, r.context)
        if text not in seen:
            seen.add(text)
            out.append(r)
    return out[:cap if cap is not None else source.cap]


def _order(r: Row) -> str:
    """A row's place in its source's deterministic order: the sha256 of its text (a row without earlier turns keeps
    the key it had before ``Row.context`` existed, so single-turn samples did not move)."""
    key = f"{r.user}\0{r.bot}"
    if r.context:
        key += "\0" + "\0".join(f"{role}:{text}" for role, text in r.context)
    return hashlib.sha256(key.encode()).hexdigest()


def all_rows(rail: str, folder: Optional[Path] = None, names: Optional[list[str]] = None,
             training_only: bool = False) -> list[Row]:
    """Every source's rows for ``rail`` (``names``: only those; ``training_only``: not the evaluation-only ones)."""
    out = []
    for s in SOURCES:
        if (names and s.name not in names) or (training_only and not s.train):
            continue
        out.extend(rows(s, rail, folder))
    return out
