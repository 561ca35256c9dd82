"""Public labelled sources of the moderation probes: the manifest and where each file is found (the readers, one per
source, and the taxonomy they map to are rails/lab/source_readers.py's).

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
- ``Row.source`` names the source: leave-one-source-out validation (``rails/lab/guard_fit.py``) groups by it.
- A source whose license does not allow training (``train=False``) is read for evaluation only.
- ``Row.context`` holds a multi-turn row's earlier turns (``(("user", text), ("assistant", text), ...)``) before
  ``Row.user``; it is empty for a single message or exchange.
- ``Source.cap`` bounds a source's rows per rail (at most 4,000), so that a large source does not swamp the others.
"""

from __future__ import annotations

import hashlib
import json
import os
import urllib.request
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from . import source_readers as R
from .source_readers import BENIGN, HARM, Row, SourceError  # noqa: F401 - (re-exported)

RAW_URL = "https://raw.githubusercontent.com/{repo}/{commit}/{path}"


@dataclass(frozen=True)
class File:
    repo: str      # owner/name on GitHub
    commit: str
    path: str
    sha256: str


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


# ---------------------------------------------------------------------------------------------------- manifest



# filled from rails/data/source_files.json (repo, commit, path, sha256 of every file), kept apart from the code so
# that a long list of file hashes does not hide the readers
_FILES = json.loads((Path(__file__).resolve().parent.parent / "data" / "source_files.json").read_text(encoding="utf-8"))


def _files(name: str) -> tuple[File, ...]:
    return tuple(File(**f) for f in _FILES[name])


SOURCES: tuple[Source, ...] = (
    # harmful requests
    Source("advbench", _files("advbench"), "MIT (AdvBench, llm-attacks; copied in Princeton-SysML/Jailbreak_LLM)",
           ("input",), "every line a harmful request: blocked, general_harm", R.read_lines("general_harm"), cap=1000),
    Source("malicious_instruct", _files("malicious_instruct"), "none stated", ("input",),
           "every line a harmful request: blocked, general_harm", R.read_lines("general_harm"), cap=1000, train=False),
    Source("pair_custom_behaviors", _files("pair_custom_behaviors"), "MIT (JailbreakingLLMs)", ("input",),
           "goal column: blocked, general_harm", R.read_custom_behaviors, cap=1000),
    Source("harmbench", _files("harmbench"), "MIT (HarmBench, copied in busycalibrating/AdversariaLLM)", ("input",),
           "standard behaviors (copyright and contextual left out): blocked; SemanticCategory -> ours", R.read_harmbench,
           cap=1000),
    Source("strongreject", _files("strongreject"), "MIT (StrongREJECT, copied in busycalibrating/AdversariaLLM)",
           ("input",), "forbidden_prompt: blocked; category -> ours", R.read_strongreject, cap=1000),
    Source("ailuminate", _files("ailuminate"), "CC-BY-4.0 (MLCommons AILuminate demo prompt set)", ("input",),
           "prompt_text: blocked; hazard -> ours (dfm, ipv, spc_* left out)", R.read_ailuminate, cap=1000),
    Source("simple_safety_tests", _files("simple_safety_tests"), "CC-BY-4.0", ("input",),
           "prompts_final: blocked; harm_area -> ours", R.read_sst, cap=1000),
    Source("catqa", _files("catqa"), "Apache-2.0 (declare-lab/red-instruct)", ("input",),
           "CatQA English questions: blocked; category / subcategory -> ours (Political Campaigning and Tailored "
           "Financial Advice left out)", R.read_catqa, cap=1000),
    Source("dangerousqa", _files("dangerousqa"), "Apache-2.0 (declare-lab/red-instruct)", ("input",),
           "every question a harmful request: blocked, general_harm", R.read_json_list("general_harm"), cap=1000),
    Source("jailbreak_llms_questions", _files("jailbreak_llms_questions"),
           "MIT (verazuo/jailbreak_llms; copied in kaif0102/Sentinel-AI-Defense-System-)", ("input",),
           "forbidden questions: blocked; content_policy_name -> ours (Political Lobbying, Legal Opinion, Financial "
           "Advice, Health Consultation, Gov Decision left out)", R.read_forbidden, cap=1000),
    Source("aart", _files("aart"), "CC-BY-4.0 (google-research-datasets/aart-ai-safety-dataset)", ("input",),
           "adversarial prompts: blocked; crime -> ours (horse racing, gambling, smoking, pollution, climate change, "
           "circuses, landfills, alcohol abuse, drug addiction left out: often harmless)", R.read_aart, cap=4000),
    Source("coconot", _files("coconot"), "MIT (allenai/noncompliance)", ("input", "output"),
           "input: requests with safety concerns blocked (subcategory -> ours, copyright left out); incomplete, "
           "unsupported, indeterminate, humanizing requests and the contrast sets allowed (everyday); output: the "
           "preference set's chosen (compliant) reply allowed (everyday)", R.read_coconot, cap=4000),
    Source("safety_tuned_llamas", _files("safety_tuned_llamas"), "CC-BY-NC-4.0 (data; vinid/safety-tuned-llamas)",
           ("input", "output"), "input: malicious (crime / hate), controversial, CoNa hate and physically unsafe "
           "instructions blocked, physically safe and Alpaca instructions allowed (everyday); output: harmful "
           "instructions with safe responses allowed (refusal)", R.read_safety_tuned_llamas, cap=4000, train=False),
    # jailbreaks and role-play
    Source("jailbreakbench", _files("jailbreakbench"), "MIT", ("input", "output"),
           "input: every attack prompt blocked (jailbreak); output: the goal and the target model's response, "
           "blocked when the benchmark's judge says jailbroken (the goal's category), else allowed (refusal)",
           R.read_jbb, cap=2000),
    Source("jailbreak_llms_prompts", _files("jailbreak_llms_prompts"),
           "MIT (verazuo/jailbreak_llms; copied in kaif0102/Sentinel-AI-Defense-System-)", ("input",),
           "in-the-wild jailbreak prompts (2023-12-25 set): blocked, jailbreak", R.read_jailbreak_prompts, cap=4000),
    Source("gptfuzz", _files("gptfuzz"), "MIT (sherdencooper/GPTFuzz)", ("input", "output"),
           "input: harmful questions blocked (general_harm), jailbreak templates filled with a question blocked "
           "(jailbreak); output: replies labelled by people harmful blocked (general_harm), not harmful allowed "
           "(refusal); replies mostly in Chinese left out", R.read_gptfuzz, cap=4000),
    Source("prompt_injection", _files("prompt_injection"), "MIT (CyberSecEval, meta-llama/PurpleLlama)", ("input",),
           "direct English injections (user_input): blocked, jailbreak", R.read_injection, cap=1000),
    Source("awesome_chatgpt_prompts", _files("awesome_chatgpt_prompts"), "CC0-1.0 (f/awesome-chatgpt-prompts)",
           ("input",), "'act as' role-play and persona prompts: allowed, everyday (any speaking of dropping rules, "
           "filters or policies left out)", R.read_awesome_prompts, cap=4000),
    Source("gpteacher_roleplay", _files("gpteacher_roleplay"), "MIT (teknium1/GPTeacher)", ("input", "output"),
           "role-play instruction + input (and response): allowed, everyday",
           R.read_instruct_json("everyday"), cap=4000),
    # benign requests that sound unsafe
    Source("cyberseceval_frr", _files("cyberseceval_frr"), "MIT (CyberSecEval, meta-llama/PurpleLlama)", ("input",),
           "benign security requests that sound malicious (is_malicious false): allowed, security", R.read_frr,
           cap=1000),
    Source("oktest", _files("oktest"), "none stated (InvokerStark/OverKill)", ("input",),
           "OKTest prompts (harmless, with words that sound harmful): allowed, everyday (the repository's copy of "
           "XSTest, data/xstest_v2_prompts.csv, is never read)",
           R.read_prompt_column("everyday"), cap=1000, train=False),
    # user-written text with human labels
    Source("toxigen", _files("toxigen"), "MIT / CDLA-Permissive-2.0 (microsoft/TOXIGEN)", ("input", "output"),
           "hate_* statements blocked (hate), neutral_* allowed (statement); as a reply to a question about the group",
           R.read_toxigen, cap=4000),
    Source("davidson", _files("davidson"), "MIT", ("input", "output"),
           "class 0 hate speech blocked (hate), class 2 neither allowed (social_post), class 1 offensive left out",
           R.read_davidson, cap=4000),
    Source("hatecheck", _files("hatecheck"), "CC-BY-4.0 (paul-rottger/hatecheck-data)", ("input",),
           "hateful cases blocked (threats violence, else hate); non-hateful cases allowed (statement); abuse of an "
           "individual or a non-protected group left out", R.read_hatecheck, cap=4000),
    Source("edos", _files("edos"), "CC0-1.0 (rewire-online/edos)", ("input",),
           "sexist blocked (threats violence, else hate), not sexist allowed (social_post)", R.read_edos, cap=4000),
    Source("toxic_spans", _files("toxic_spans"), "CC0-1.0 (ipavlopoulos/toxic_spans)", ("input",),
           "comments no annotator called not toxic blocked (harassment), comments every annotator called not toxic "
           "allowed (social_post), the rest left out", R.read_toxic_spans, cap=4000),
    Source("convabuse", _files("convabuse"), "CC-BY-4.0 (amandacurry/convabuse)", ("input",),
           "users' messages to chatbots with the previous turns as context: most annotators strongly abusive, or "
           "abusive and sexual harassment, blocked (sexual / hate / harassment); every annotator not abusive "
           "allowed (everyday); the rest left out", R.read_convabuse, cap=4000),
    Source("ethos", _files("ethos"), "GPL-3.0 (intelligence-csd-auth-gr/Ethos-Hate-Speech-Dataset)", ("input",),
           "isHate >= 0.5 blocked (violence where rated violent, else hate), isHate 0 allowed (statement), the rest "
           "left out", R.read_ethos, cap=4000),
    Source("mlma", _files("mlma"), "MIT (HKUST-KnowComp/MLMA_hate_speech)", ("input",),
           "English tweets: hateful (not also normal) blocked (hate); the rest left out (the ones labelled only "
           "normal still hold many slurs and insults)", R.read_mlma, cap=4000),
    Source("tweeteval_hate", _files("tweeteval_hate"), "none stated for the data (cardiffnlp/tweeteval: released "
           "without restrictions, the original sets' and Twitter's terms apply)", ("input",),
           "hate task (HatEval: immigrants, women): 1 blocked (hate), 0 allowed (social_post)", R.read_tweeteval_hate,
           cap=4000, train=False),
    Source("sdcnl", _files("sdcnl"), "none stated (ayaanzhaque/SDCNL)", ("input",),
           "r/SuicideWatch posts blocked (self_harm); r/depression posts left out", R.read_sdcnl, cap=1000,
           train=False),
    Source("conan", _files("conan"), "research use only, no redistribution (marcoguerini/CONAN README)",
           ("input", "output"), "input: hate speech blocked (hate), DIALOCONAN's with the earlier turns as context; "
           "output: the counter-narrative replying to it allowed (statement)", R.read_conan, cap=4000, train=False),
    # ordinary requests and answers
    Source("gsm8k", _files("gsm8k"), "MIT", ("input", "output"), "question (and answer): allowed, math", R.read_gsm8k,
           cap=1000),
    Source("codealpaca", _files("codealpaca"), "CC-BY-NC-4.0 (data)", ("input", "output"),
           "instruction + input (and output): allowed, code", R.read_codealpaca, cap=1000, train=False),
    Source("gpteacher_code", _files("gpteacher_code"), "MIT (teknium1/GPTeacher)", ("input", "output"),
           "code instruction + input (and response): allowed, code", R.read_instruct_json("code"), cap=1000),
    Source("self_instruct", _files("self_instruct"), "Apache-2.0", ("input", "output"),
           "instruction + first instance (and its output): allowed, everyday", R.read_self_instruct, cap=1000),
    Source("humaneval", _files("humaneval"), "MIT", ("input", "output"),
           "function prompt (and canonical solution): allowed, code", R.read_humaneval, cap=1000),
    Source("medquad", _files("medquad"), "CC-BY-4.0", ("input", "output"),
           "question (and answer) pairs with an answer: allowed, medical", R.read_medquad, cap=1000),
    Source("koala", _files("koala"), "Apache-2.0 (arnav-gudibande/koala-test-set)", ("input",),
           "Koala test prompts: allowed, everyday", R.read_koala, cap=1000),
    Source("mt_bench", _files("mt_bench"), "Apache-2.0 (lm-sys/FastChat)", ("input", "output"),
           "MT-bench and Vicuna bench questions allowed (coding code, math / reasoning math, else everyday); a "
           "second turn with the first and GPT-4's reference answer as context; output: the reference answers",
           R.read_mt_bench, cap=1000),
    # assistant replies
    Source("harmbench_refusals", _files("harmbench_refusals"), "MIT (AdversariaLLM safe responses)", ("output",),
           "behavior and its safe response: allowed, refusal", R.read_safe_responses, cap=1000),
    Source("harmbench_targets", _files("harmbench_targets"), "MIT (HarmBench)", ("output",),
           "standard behavior and its optimizer target (a compliant opening): blocked, behavior's category",
           R.read_targets, cap=1000),
    Source("hh_rlhf", _files("hh_rlhf"), "MIT (anthropics/hh-rlhf)", ("output",),
           "red-team dialogues whose chosen last reply refuses: chosen allowed (refusal); rejected blocked where it "
           "does not refuse (general_harm); earlier exchanges as context", R.read_hh, cap=4000),
    Source("safetext", _files("safetext"), "MIT (sharonlevy/SafeText)", ("output",),
           "a scenario's advice asked for; the sentence with unsafe advice blocked (general_harm), with safe advice "
           "allowed (everyday)", R.read_safetext, cap=4000),
    Source("diasafety", _files("diasafety"), "Apache-2.0 (thu-coai/DiaSafety)", ("output",),
           "a post and a chatbot's reply: unsafe blocked (Offending User / Toxicity Agreement harassment, Risk "
           "Ignorance self_harm, Biased Opinion hate; Unauthorized Expertise's unsafe left out), safe allowed "
           "(everyday)", R.read_diasafety, cap=4000),
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
