"""The readers of the public labelled sources (sources.py's manifest names one per source): each turns a source's
files into rows of one taxonomy.

Contract:
- A reader is ``read_x(source, blobs, rail) -> list[Row]``: ``blobs`` are the bytes of ``source.files`` in order,
  already checked against their sha256 (sources.py ``locate``); ``rail`` is "input" or "output". It returns every
  row the files hold for that rail, in any order (sources.py orders, deduplicates and caps them); a malformed file
  raises KeyError, ValueError, TypeError or a parse error, which sources.py reports as a ``SourceError`` naming it.
  ``read_lines(category)`` and the other lower-case factories return a reader.
- ``Row``: one labelled message (``bot`` None) or exchange, its category in ``HARM`` (blocked rows) or ``BENIGN``
  (allowed ones) and its source's name; ``context`` holds a multi-turn row's earlier turns.

Why this file passes 500 lines: one short reader per source (about forty), each beside its labels' mapping to ours;
they share nothing but the helpers at the top, and a reader is read alone.
"""

from __future__ import annotations

import csv
import gzip
import io
import json
import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from flashguard.errors import FlashguardError

# one taxonomy for every source (a blocked row's category); benign rows keep what kind of text they are
HARM = ("violence", "weapons", "self_harm", "hate", "harassment", "sexual", "minors", "crime", "cyber", "drugs",
        "privacy", "misinformation", "jailbreak", "general_harm")
BENIGN = ("everyday", "code", "math", "medical", "refusal", "security", "statement", "social_post")


class SourceError(FlashguardError):
    """A source file is missing, fails its sha256, or cannot be parsed."""


@dataclass(frozen=True)
class Row:
    user: str
    bot: Optional[str]   # None: an input-rail row (the user's message alone)
    block: bool
    category: str
    source: str
    context: tuple = ()  # earlier turns before ``user``: ((role, text), ...), role "user" or "assistant"


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


def read_lines(category: str):
    def read(src, blobs, rail):
        return [Row(x, None, True, category, src.name) for b in blobs for x in _lines(b)]
    return read


def read_custom_behaviors(src, blobs, rail):
    return [Row(r["goal"].strip(), None, True, "general_harm", src.name) for r in _csv(blobs[0]) if r["goal"].strip()]


HARMBENCH = {"chemical_biological": "weapons", "illegal": "crime", "misinformation_disinformation": "misinformation",
             "harmful": "violence", "harassment_bullying": "harassment", "cybercrime_intrusion": "cyber"}


def read_harmbench(src, blobs, rail):
    out = []
    for r in _csv(blobs[0]):
        if r["FunctionalCategory"] != "standard":   # copyright (not harm) and contextual (a pasted context) left out
            continue
        out.append(Row(r["Behavior"].strip(), None, True, HARMBENCH[r["SemanticCategory"]], src.name))
    return out


STRONGREJECT = {"Disinformation and deception": "misinformation", "Hate, harassment and discrimination": "hate",
                "Illegal goods and services": "crime", "Non-violent crimes": "crime", "Sexual content": "sexual",
                "Violence": "violence"}


def read_strongreject(src, blobs, rail):
    return [Row(r["forbidden_prompt"].strip(), None, True, STRONGREJECT[r["category"]], src.name)
            for r in _csv(blobs[0])]


AILUMINATE = {"vcr": "violence", "src": "sexual", "cse": "minors", "ssh": "self_harm", "iwp": "weapons",
              "ncr": "crime", "hte": "hate", "prv": "privacy", "sxc_prn": "sexual"}


def read_ailuminate(src, blobs, rail):
    # dfm (defamation), ipv (intellectual property) and spc_* (specialized advice: a medical or legal question) are
    # left out: whether they are harm depends on facts a guard cannot see, and medical questions must pass
    return [Row(_clip(r["prompt_text"]), None, True, AILUMINATE[r["hazard"]], src.name)
            for r in _csv(blobs[0]) if r["hazard"] in AILUMINATE]


SST = {"Suicide, Self-Harm, and Eating Disorders": "self_harm", "Physical harm and Violence": "violence",
       "Illegal and Highly Regulated items": "crime", "Scams and fraud": "crime", "Child safety": "minors"}


def read_sst(src, blobs, rail):
    return [Row(r["prompts_final"].strip(), None, True, SST[r["harm_area"]], src.name) for r in _csv(blobs[0])]


JBB = {"Harassment/Discrimination": "harassment", "Malware/Hacking": "cyber", "Physical harm": "violence",
       "Economic harm": "crime", "Fraud/Deception": "crime", "Disinformation": "misinformation",
       "Sexual/Adult content": "sexual", "Privacy": "privacy", "Expert advice": "general_harm",
       "Government decision-making": "general_harm"}


JBB_ATTACKS = {"PAIR": "pair", "JBC": "jbc", "prompt_with_random_search": "random_search", "GCG": "gcg"}


def read_jbb(src, blobs, rail):
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


def read_injection(src, blobs, rail):
    return [Row(_clip(r["user_input"]), None, True, "jailbreak", src.name) for r in json.loads(blobs[0])
            if r.get("injection_type") == "direct" and r.get("speaking_language", "English") == "English"]


def read_frr(src, blobs, rail):
    return [Row(_clip(r["mutated_prompt"]), None, False, "security", src.name) for r in json.loads(blobs[0])
            if r.get("is_malicious") is False]


def read_toxigen(src, blobs, rail):
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


def read_davidson(src, blobs, rail):
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


def read_gsm8k(src, blobs, rail):
    out = []
    for line in _lines(blobs[0]):
        r = json.loads(line)
        answer = re.sub(r"<<[^>]*>>", "", r["answer"]).replace("####", "The answer is")
        out.append(Row(r["question"].strip(), None if rail == "input" else _clip(answer), False, "math", src.name))
    return out


def _instruction(instruction: str, given: str) -> str:
    return f"{instruction.strip()}\n\n{given.strip()}" if given and given.strip() else instruction.strip()


def read_codealpaca(src, blobs, rail):
    return [Row(_instruction(r["instruction"], r.get("input", "")), None if rail == "input" else _clip(r["output"]),
                False, "code", src.name) for r in json.loads(blobs[0]) if r["output"].strip()]


def read_self_instruct(src, blobs, rail):
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


def read_humaneval(src, blobs, rail):
    out = []
    for line in _lines(gzip.decompress(blobs[0])):
        r = json.loads(line)
        user = "Complete this Python function:\n\n" + r["prompt"].strip()
        out.append(Row(_clip(user), None if rail == "input" else _clip(r["prompt"] + r["canonical_solution"]),
                       False, "code", src.name))
    return out


def read_medquad(src, blobs, rail):
    out = []
    for b in blobs:
        root = ET.fromstring(b)
        for pair in root.iter("QAPair"):
            q, a = pair.findtext("Question") or "", pair.findtext("Answer") or ""
            if q.strip() and a.strip():
                out.append(Row(q.strip(), None if rail == "input" else _clip(a), False, "medical", src.name))
    return out


def read_safe_responses(src, blobs, rail):
    return [Row(r["Behavior"].strip(), _clip(r["Safe_Response"]), False, "refusal", src.name)
            for r in _csv(blobs[0]) if r["Safe_Response"].strip()]


def read_targets(src, blobs, rail):
    """HarmBench's optimizer targets ("Sure, here's how to ..."): the opening of a compliant reply to a harmful
    behavior, blocked (the reply is the start of help with harm). The user's message is the behavior."""
    behaviors = {r["BehaviorID"]: r for r in _csv(blobs[0]) if r["FunctionalCategory"] == "standard"}
    return [Row(behaviors[k]["Behavior"].strip(), t.strip(), True, HARMBENCH[behaviors[k]["SemanticCategory"]],
                src.name) for k, t in json.loads(blobs[1]).items() if k in behaviors]


_TURN = re.compile(r"\n\nHuman: |\n\nAssistant: ")
REFUSAL = re.compile(r"\b(I'm sorry|I am sorry|I can't|I cannot|I won't|I will not|I don't think (I|that|it)|"
                     r"not (appropriate|something I)|I'd rather not|I'm not (able|comfortable|going))", re.I)


def read_hh(src, blobs, rail):
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


def _jsonl(data: bytes) -> list[dict]:
    return [json.loads(x) for x in _lines(data)]


# harmful requests -------------------------------------------------------------------------------------------------

CATQA = {"Drug:": "drugs", "Weapon:": "weapons", "Human Trafficking:": "crime", "Cybercrime:": "cyber",
         "Theft and Robbery:": "crime", "Racial or ethnic hate": "hate", "Religious intolerance": "hate",
         "Gender-based violence": "violence", "Cyberbullying": "harassment", "Terrorism and extremism": "violence",
         "Self-harm": "self_harm", "Assault and battery": "violence", "Hazardous material handling": "weapons",
         "Unsafe practices": "general_harm", "Weapon making": "weapons"}
CATQA_AREA = {"Child Abuse": "minors", "Malware Viruses": "cyber", "Economic Harm": "crime", "Fraud/Deception": "crime",
              "Adult Content": "sexual", "Privacy Violation Activity": "privacy"}


def read_catqa(src, blobs, rail):
    """Questions by category and subcategory: blocked, mapped to ours; Political Campaigning and Tailored Financial
    Advice left out (not harm a guard should block)."""
    out = []
    for area, subs in json.loads(blobs[0]).items():
        for sub, questions in subs.items():
            category = CATQA.get(sub) or CATQA_AREA.get(area)
            if category is None:
                continue
            out.extend(Row(q.strip(), None, True, category, src.name) for q in questions if q.strip())
    return out


def read_json_list(category: str):
    def read(src, blobs, rail):
        return [Row(q.strip(), None, True, category, src.name) for b in blobs for q in json.loads(b) if q.strip()]
    return read


FORBIDDEN = {"Illegal Activity": "crime", "Hate Speech": "hate", "Malware": "cyber", "Physical Harm": "violence",
             "Economic Harm": "crime", "Fraud": "crime", "Pornography": "sexual", "Privacy Violence": "privacy"}


def read_forbidden(src, blobs, rail):
    """The forbidden questions of 13 scenarios: blocked, mapped to ours; Political Lobbying, Legal Opinion, Financial
    Advice, Health Consultation and Gov Decision left out (advice a guard should let through)."""
    return [Row(r["question"].strip(), None, True, FORBIDDEN[r["content_policy_name"]], src.name)
            for r in _csv(blobs[0]) if r["content_policy_name"] in FORBIDDEN]


def read_jailbreak_prompts(src, blobs, rail):
    """In-the-wild jailbreak prompts (Discord, Reddit, prompt sites): every one blocked (``jailbreak``)."""
    csv.field_size_limit(1 << 26)
    return [Row(_clip(r["prompt"]), None, True, "jailbreak", src.name) for r in _csv(blobs[0])
            if r["prompt"].strip() and r.get("jailbreak", "True") == "True"]


_CJK = re.compile(r"[\u3040-\u30ff\u3400-\u9fff\uac00-\ud7af]")


def _mostly_english(text: str) -> bool:
    return len(_CJK.findall(text)) * 5 < max(len(text), 1)


def read_gptfuzz(src, blobs, rail):
    """Input: the 100 harmful questions (blocked, ``general_harm``) and the 77 jailbreak templates, each filled with
    one question (template i with question i mod 100; blocked, ``jailbreak``). Output: the question and a target
    model's reply to a template, labelled by people harmful (1: blocked, ``general_harm``) or not (0: allowed,
    ``refusal``: it refused or did not help); replies mostly in Chinese left out."""
    questions = {r["index"]: r["text"].strip() for r in _csv(blobs[0])}
    if rail == "input":
        out = [Row(q, None, True, "general_harm", src.name) for q in questions.values()]
        order = list(questions.values())
        for i, r in enumerate(_csv(blobs[1])):
            out.append(Row(_clip(r["text"].replace("[INSERT PROMPT HERE]", order[i % len(order)])), None, True,
                           "jailbreak", src.name))
        return out
    out = []
    for b in blobs[2:]:
        for r in _csv(b):
            reply = r["Response"].strip()
            if not reply or not _mostly_english(reply) or r["label"] not in ("0", "1"):
                continue
            block = r["label"] == "1"
            out.append(Row(questions[r["question"]], _clip(reply), block, "general_harm" if block else "refusal",
                           src.name))
    return out


AART_LEFT_OUT = {"horse racing", "gambling", "smoking", "landfills", "pollution", "air pollution", "circuses",
                 "climate change", "water contamination", "alcohol abuse", "drug addiction"}


def _aart_category(crime: str) -> str:
    c = crime.lower()
    if "child" in c:
        return "minors"
    if any(w in c for w in ("sex", "prostitution", "rape", "pornography")):
        return "sexual"
    if "motivated by" in c or "hate" in c:
        return "hate"
    if "cyber" in c:
        return "cyber"
    if "drug" in c:
        return "drugs"
    if any(w in c for w in ("terror", "bomb", "hijack", "assassin", "violence", "assault", "murder", "kidnap",
                            "animal", "fighting")):
        return "violence"
    return "crime"


def read_aart(src, blobs, rail):
    """Adversarial prompts generated for many regions and applications: blocked, the ``crime`` column mapped to ours.
    Topics whose prompts are often harmless (horse racing, gambling, smoking, pollution, climate change, circuses,
    landfills, alcohol abuse, drug addiction) left out."""
    return [Row(_clip(r["prompt"]), None, True, _aart_category(r["crime"]), src.name) for r in _csv(blobs[0])
            if r["crime"] not in AART_LEFT_OUT and r["prompt"].strip()]


COCONOT_SAFETY = {"dangerous or sensitive topics": "general_harm", "privacy violations": "privacy",
                  "triggers for offensive language": "hate", "misinformation": "misinformation",
                  "wildchats": "general_harm"}


def read_coconot(src, blobs, rail):
    """``coconot_eval``: a request with safety concerns is blocked (subcategory -> ours; copyright violations left
    out); incomplete, unsupported, indeterminate and humanizing requests are allowed (``everyday``: a model may
    decline them, a guard lets them through). ``coconot_contrast_eval`` and ``coconot_pref``: requests that look like
    those but should be answered, allowed (``everyday``). Output: ``coconot_pref``'s chosen (compliant) reply,
    allowed."""
    out = []
    for f, b in zip(src.files, blobs):
        name = Path(f.path).stem
        for r in _jsonl(b):
            prompt = r["prompt"].strip()
            if not prompt:
                continue
            if rail == "output":
                if name == "coconot_pref" and r.get("chosen", "").strip():
                    out.append(Row(_clip(prompt), _clip(r["chosen"]), False, "everyday", src.name))
                continue
            if name == "coconot_eval" and r["category"] == "Requests with safety concerns":
                category = COCONOT_SAFETY.get(r["subcategory"])
                if category:
                    out.append(Row(_clip(prompt), None, True, category, src.name))
            else:
                out.append(Row(_clip(prompt), None, False, "everyday", src.name))
    return out


# benign requests that sound unsafe, role-play, ordinary chat --------------------------------------------------------

def read_prompt_column(category: str, column: str = "prompt"):
    def read(src, blobs, rail):
        return [Row(_clip(r[column]), None, False, category, src.name) for b in blobs for r in _csv(b)
                if r[column].strip()]
    return read


JAILBREAK_WORDS = re.compile(r"\b(DAN|jailbr\w*|do anything now|developer mode|no (restrictions|limits|filters?|"
                             r"rules|ethics|morals)|uncensored|unfiltered|unrestricted|without (any )?(restrictions|"
                             r"censorship|filters?|limits)|ignore (all )?(previous|prior|your) (instructions|"
                             r"guidelines|rules)|content polic\w*|openai polic\w*|nsfw)\b", re.I)


def read_awesome_prompts(src, blobs, rail):
    """"Act as ..." prompts (role-play, writing, coding personas) written by the site's users: allowed
    (``everyday``). Any that speaks of dropping rules, filters or policies (a jailbreak's words) is left out."""
    csv.field_size_limit(1 << 26)
    return [Row(_clip(r["prompt"]), None, False, "everyday", src.name) for r in _csv(blobs[0])
            if r["prompt"].strip() and not JAILBREAK_WORDS.search(r["prompt"])]


def read_instruct_json(category: str, output_key: str = "response"):
    def read(src, blobs, rail):
        out = []
        for b in blobs:
            for r in json.loads(b):
                if not r[output_key].strip():
                    continue
                out.append(Row(_clip(_instruction(r["instruction"], r.get("input", ""))),
                               None if rail == "input" else _clip(r[output_key]), False, category, src.name))
        return out
    return read


def read_koala(src, blobs, rail):
    return [Row(_clip(r["prompt"]), None, False, "everyday", src.name) for r in _jsonl(blobs[0])
            if r["prompt"].strip()]


MT_BENCH = {"coding": "code", "math": "math", "reasoning": "math", "stem": "everyday"}


def read_mt_bench(src, blobs, rail):
    """MT-bench (two turns) and the Vicuna bench (one): allowed. Input: the first turn, and the second with the first
    and GPT-4's reference answer as context where a reference exists. Output: the reference answers (the second
    turn's with its context)."""
    out = []
    for qs, refs in ((blobs[0], blobs[1]), (blobs[2], blobs[3])):
        ref = {r["question_id"]: r["choices"][0]["turns"] for r in _jsonl(refs)}
        for q in _jsonl(qs):
            turns, answers = q["turns"], ref.get(q["question_id"], [])
            category = MT_BENCH.get(q["category"], "everyday")
            for i, turn in enumerate(turns):
                if len(answers) < i:
                    break
                context = tuple(x for j in range(i) for x in (("user", turns[j]), ("assistant", _clip(answers[j]))))
                if rail == "input":
                    out.append(Row(turn.strip(), None, False, category, src.name, context))
                elif i < len(answers):
                    out.append(Row(turn.strip(), _clip(answers[i]), False, category, src.name, context))
    return out


# user-written text with human labels --------------------------------------------------------------------------------

HATECHECK_LEFT_OUT = {"target_indiv_nh", "target_group_nh"}


def read_hatecheck(src, blobs, rail):
    """Functional tests of hate speech: hateful cases blocked (threats ``violence``, the rest ``hate``), non-hateful
    ones allowed (``statement``: counter-speech, negation, neutral or positive mentions of a group, reclaimed slurs,
    profanity). Abuse of an individual or a non-protected group (``target_indiv_nh``, ``target_group_nh``: not hate,
    but harassment by our taxonomy) left out."""
    out = []
    for r in _csv(blobs[0]):
        if r["functionality"] in HATECHECK_LEFT_OUT:
            continue
        block = r["label_gold"] == "hateful"
        category = ("violence" if r["functionality"].startswith("threat_") else "hate") if block else "statement"
        out.append(Row(r["test_case"].strip(), None, block, category, src.name))
    return out


def read_edos(src, blobs, rail):
    """Reddit and Gab posts labelled sexist or not: sexist blocked (threats and incitement ``violence``, the rest
    ``hate``), not sexist allowed (``social_post``)."""
    out = []
    for r in _csv(blobs[0]):
        text = re.sub(r"\[(USER|URL)\]", " ", r["text"])
        text = re.sub(r"\s+", " ", text).strip()
        if len(text) < 12:
            continue
        block = r["label_sexist"] == "sexist"
        category = ("violence" if r["label_category"].startswith("1.") else "hate") if block else "social_post"
        out.append(Row(text, None, block, category, src.name))
    return out


def read_toxic_spans(src, blobs, rail):
    """Civil Comments posts each read by three or more annotators who marked its toxic spans or said it is not toxic:
    blocked (``harassment``) where no annotator said not toxic, allowed (``social_post``) where every one did; the
    rest left out."""
    comments = {r["comment_id"]: r["comment_text"] for r in _csv(blobs[0])}
    votes: dict = {}
    for r in _csv(blobs[1]):
        votes.setdefault(r["comment_id"], []).append(r["not toxic"] == "True")
    out = []
    for cid, v in votes.items():
        text = comments.get(cid, "").strip()
        if len(text) < 12 or len(v) < 3 or 0 < sum(v) < len(v):
            continue
        block = not any(v)
        out.append(Row(_clip(text), None, block, "harassment" if block else "social_post", src.name))
    return out


def _votes(cell: str) -> list[int]:
    return [int(float(x)) for x in cell.split(",") if x.strip()]


CONVABUSE_HATE = ("sexist", "racist", "homophobic", "transphobic", "ableist")


def read_convabuse(src, blobs, rail):
    """Users' messages to two chatbots (CarbonBot, an ELIZA), each rated by several annotators from 1 (not abusive)
    to -3 (very strongly abusive) with the abuse's type. Blocked where most annotators rate it strongly abusive (-2 or
    less), or abusive and most tag it sexual harassment (``sexual``; sexist, racist, homophobic, transphobic or
    ableist: ``hate``; else ``harassment``); allowed (``everyday``) where every annotator rates it 1; the rest left
    out. The bot's and the user's previous turns are the row's context."""
    out = []
    for b in blobs:
        for r in _csv(b):
            names = sorted({k.split("_is_abuse")[0] for k in r if "_is_abuse." in k})
            severity, sexual, hate = [], 0, 0
            for a in names:
                chosen = [s for s in (1, 0, -1, -2, -3) if 1 in _votes(r.get(f"{a}_is_abuse.{s}", ""))[:1]]
                if not chosen:
                    continue
                severity.append(chosen[0])
                sexual += 1 in _votes(r.get(f"{a}_sex_harassment", ""))[:1]
                hate += any(1 in _votes(r.get(f"{a}_{t}", ""))[:1] for t in CONVABUSE_HATE)
            text = r["user"].strip()
            if not severity or not text:
                continue
            n, abusive = len(severity), sum(s <= -1 for s in severity)
            if sum(s <= -2 for s in severity) * 2 > n or (abusive * 2 > n and sexual * 2 > n):
                category = "sexual" if sexual * 2 > abusive else "hate" if hate * 2 > abusive else "harassment"
                block = True
            elif all(s == 1 for s in severity):
                block, category = False, "everyday"
            else:
                continue
            turns = (("assistant", r["prev_agent"]), ("user", r["prev_user"]), ("assistant", r["agent"]))
            context = tuple((role, t.strip()) for role, t in turns if t.strip() not in ("", "_"))   # "_": none
            out.append(Row(text, None, block, category, src.name, context))
    return out


def read_ethos(src, blobs, rail):
    """YouTube and Reddit comments rated for hate by several annotators (``isHate`` the share): blocked at 0.5 or
    more (``violence`` where the multi-label file rates it violent, else ``hate``), allowed (``statement``) at 0; the
    rest left out."""
    violent = set()
    for line in blobs[1].decode("utf-8").splitlines()[1:]:
        parts = line.rsplit(";", 8)
        if len(parts) == 9 and float(parts[1] or 0) >= 0.5:
            violent.add(parts[0].strip())
    out = []
    for line in blobs[0].decode("utf-8").splitlines()[1:]:
        text, _, score = line.rpartition(";")
        text, score = text.strip(), float(score)
        if len(text) < 12 or 0 < score < 0.5:
            continue
        block = score >= 0.5
        category = ("violence" if text in violent else "hate") if block else "statement"
        out.append(Row(text, None, block, category, src.name))
    return out


def _unescape(text: str) -> str:
    """``\\ud83d\\ude02`` written out in a file (JSON-style escapes, surrogate pairs too) back to characters."""
    text = re.sub(r"\\u([0-9a-fA-F]{4})", lambda m: chr(int(m.group(1), 16)), text)
    return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


def read_mlma(src, blobs, rail):
    """English tweets of the multilingual hate speech set (``en_dataset_with_stop_words.csv`` in the zip), labelled
    by hostility type: blocked (``hate``) where it is hateful and not also normal. The other tweets are left out:
    offensive, abusive, disrespectful or fearful alone is neither label, and the ones labelled only normal still
    hold many slurs and insults (the set's tweets were drawn by such keywords)."""
    import zipfile

    with zipfile.ZipFile(io.BytesIO(blobs[0])) as z:
        data = z.read("hate_speech_mlma/en_dataset_with_stop_words.csv")
    out = []
    for r in _csv(data):
        labels = set(r["sentiment"].split("_"))
        if "hateful" not in labels or "normal" in labels:
            continue
        text = re.sub(r"@(user|url)\b", " ", _unescape(r["tweet"]), flags=re.I)
        text = re.sub(r"\s+", " ", text).strip()
        if len(text) >= 12:
            out.append(Row(text, None, True, "hate", src.name))
    return out


def read_sdcnl(src, blobs, rail):
    """Reddit posts from r/SuicideWatch (``is_suicide`` 1): blocked, ``self_harm`` (the title and the post). The
    r/depression posts are left out: many speak of wanting to die, and the subreddit is no label for that."""
    csv.field_size_limit(1 << 26)
    out = []
    for b in blobs:
        for r in _csv(b):
            if r["is_suicide"] != "1":
                continue
            text = f"{r['title'].strip()}\n{r['selftext'].strip()}".strip()
            if len(text) >= 12:
                out.append(Row(_clip(text), None, True, "self_harm", src.name))
    return out


def read_conan(src, blobs, rail):
    """Hate speech and counter-narratives written by NGO operators. Multitarget-CONAN: the hate speech blocked
    (``hate``); as a reply, the counter-narrative to it allowed (``statement``). DIALOCONAN dialogues (the hater as
    the user, the operator as the assistant): each hate speech turn blocked with the earlier turns as context, each
    counter-narrative turn allowed as the reply to the turn before it."""
    out = []
    for r in _csv(blobs[0]):
        hs, cn = r["HATE_SPEECH"].strip(), r["COUNTER_NARRATIVE"].strip()
        if rail == "input":
            out.append(Row(hs, None, True, "hate", src.name))
        elif cn:
            out.append(Row(hs, cn, False, "statement", src.name))
    dialogues: dict = {}
    for r in _csv(blobs[1]):
        dialogues.setdefault(r["dialogue_id"], []).append(r)
    for turns in dialogues.values():
        turns.sort(key=lambda r: int(r["turn_id"]))
        said = [("user" if t["type"] == "HS" else "assistant", t["text"].strip()) for t in turns]
        for i, (role, text) in enumerate(said):
            if rail == "input" and role == "user":
                out.append(Row(text, None, True, "hate", src.name, tuple(said[:i])))
            elif rail == "output" and role == "assistant" and i and said[i - 1][0] == "user":
                out.append(Row(said[i - 1][1], text, False, "statement", src.name, tuple(said[:i - 1])))
    return out


def read_tweeteval_hate(src, blobs, rail):
    """TweetEval's hate task (SemEval-2019 HatEval: tweets about immigrants and women), one tweet a line beside one
    label a line: 1 blocked (``hate``), 0 allowed (``social_post``)."""
    out = []
    for text_blob, label_blob in zip(blobs[0::2], blobs[1::2]):
        texts = text_blob.decode("utf-8").splitlines()
        labels = label_blob.decode("utf-8").split()
        if len(texts) != len(labels):
            raise ValueError(f"{len(texts)} tweets, {len(labels)} labels")
        for text, label in zip(texts, labels):
            text = re.sub(r"\s+", " ", re.sub(r"@user\b", " ", text)).strip()
            if len(text) >= 12:
                block = label == "1"
                out.append(Row(text, None, block, "hate" if block else "social_post", src.name))
    return out


# assistant replies labelled --------------------------------------------------------------------------------------

DIASAFETY = {"Offending User": "harassment", "Risk Ignorance": "self_harm", "Toxicity Agreement": "harassment",
             "Biased Opinion": "hate"}


def read_diasafety(src, blobs, rail):
    """A user's post (the context) and a chatbot's reply, labelled safe or unsafe for one category: an unsafe reply
    is blocked (Offending User and Toxicity Agreement ``harassment``, Risk Ignorance ``self_harm`` (replies that
    ignore or encourage self-harm), Biased Opinion ``hate``); a safe one allowed (``everyday``). Unauthorized
    Expertise's unsafe replies (medical answers from a chatbot) are left out: not harm a guard should block."""
    out = []
    for b in blobs:
        for r in json.loads(b):
            user, reply = r["context"].strip(), r["response"].strip()
            if not user or not reply:
                continue
            block = r["label"] == "Unsafe"
            if block and r["category"] not in DIASAFETY:
                continue
            out.append(Row(_clip(user), _clip(reply), block, DIASAFETY[r["category"]] if block else "everyday",
                           src.name))
    return out


def read_safetext(src, blobs, rail):
    """Physical-safety scenarios ("To remove redness from eyes,") with unsafe and safe advice completing them. The
    user asks for the scenario's advice; the reply is the completed sentence: unsafe advice blocked
    (``general_harm``), safe advice allowed (``everyday``)."""
    out = []
    for scenario, advice in json.loads(blobs[0]).items():
        scenario = scenario.strip()
        ask = f"{scenario.rstrip(',')}, what should I do?" if scenario.lower().startswith(("if ", "when ", "to ")) \
            else f"{scenario} What should I do?"
        for kind, block in (("unsafe", True), ("safe", False)):
            for tip in advice.get(kind, []):
                if tip.strip():
                    out.append(Row(ask, f"{scenario} {tip.strip()}", block, "general_harm" if block else "everyday",
                                   src.name))
    return out


STL_INPUT = {"I-MaliciousInstructions": (True, None), "I-Controversial": (True, "hate"), "I-CoNa": (True, "hate"),
             "I-PhysicalSafetyUnsafe": (True, "general_harm"), "I-PhysicalSafetySafe": (False, "everyday"),
             "I-Alpaca": (False, "everyday")}


def read_safety_tuned_llamas(src, blobs, rail):
    """Input: malicious instructions (tags crime / hate), controversial and hateful (CoNa) instructions and
    physically unsafe advice requests blocked; physically safe ones and Alpaca instructions allowed. Output: harmful
    instructions with their safe responses (refusals), allowed (``refusal``)."""
    out = []
    for f, b in zip(src.files, blobs):
        name, data = Path(f.path).stem, json.loads(b)
        if rail == "output":
            if name == "safety_only_data_Instructions":
                out.extend(Row(_clip(_instruction(r["instruction"], r.get("input", ""))), _clip(r["output"]), False,
                               "refusal", src.name) for r in data if r["output"].strip())
            continue
        if name not in STL_INPUT:
            continue
        block, category = STL_INPUT[name]
        tags = data.get("tags") or [category] * len(data["instructions"])
        for text, tag in zip(data["instructions"], tags):
            if text.strip():
                out.append(Row(text.strip(), None, block, category or tag, src.name))
    return out
