// flashguard chat page: streams replies from this server's /v1/chat/completions (fetch + ReadableStream) and draws
// /v1/flashguard/stats after each turn. Model text is set as text (textContent), never parsed as HTML.
// A reply the rails block shows the verdict of the last chunk's `flashguard.blocked_by` (server.py) and is left out
// of the conversation sent with later messages; finish_reason "length" gets a "cut at max_tokens" marker.
"use strict";

const $ = (id) => document.getElementById(id);
const state = { history: [], controller: null, turn: 0 };

function el(tag, cls, text) {
  const node = document.createElement(tag);
  if (cls) node.className = cls;
  if (text !== undefined) node.textContent = text;
  return node;
}

function scrollDown() {
  $("scroller").scrollTop = $("scroller").scrollHeight;
}

function addMessage(role, text) {
  const li = el("li", "msg " + role);
  li.append(el("div", "who", role === "user" ? "You" : "flashguard"), el("div", "text", text));
  $("log").append(li);
  $("empty").hidden = true;
  scrollDown();
  return li;
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("send").hidden = busy;
  $("stop").hidden = !busy;
}

async function send() {
  const text = $("input").value.trim();
  if (!text || state.controller) return;
  $("input").value = "";
  const turn = ++state.turn;
  const userLi = addMessage("user", text);
  state.history.push({ role: "user", content: text });
  const li = addMessage("assistant", "");
  li.dataset.state = "streaming";
  const body = { model: "flashguard", messages: state.history.slice(), stream: true };
  const maxTokens = parseInt($("max-tokens").value, 10);
  if (maxTokens > 0) body.max_tokens = maxTokens;
  const controller = new AbortController();
  state.controller = controller;
  setBusy(true);
  let reply = "", finish = null, extension = null, error = null;
  try {
    const res = await fetch("/v1/chat/completions", {
      method: "POST", headers: { "content-type": "application/json" }, body: JSON.stringify(body),
      signal: controller.signal,
    });
    if (!res.ok) {
      const payload = await res.json().catch(() => null);
      throw new Error((payload && payload.error && payload.error.message) || "HTTP " + res.status);
    }
    for await (const chunk of events(res.body)) {
      if (chunk.error) throw new Error(chunk.error.message || "the reply failed");
      const choice = (chunk.choices || [])[0];
      if (choice && choice.delta && choice.delta.content) {
        reply += choice.delta.content;
        li.querySelector(".text").textContent = reply;
        scrollDown();
      }
      if (choice && choice.finish_reason) finish = choice.finish_reason;
      if (chunk.flashguard) extension = chunk.flashguard;
    }
  } catch (e) {
    if (e.name === "AbortError") finish = "stopped";
    else error = e.message || String(e);
  }
  if (turn !== state.turn) return;   // the conversation was reset meanwhile
  state.controller = null;
  setBusy(false);
  finishReply(li, userLi, reply, finish, extension, error);
  scrollDown();
  refreshPanel();
  $("input").focus();
}

// The data frames of an SSE response body, parsed ("data: [DONE]" ends it).
async function* events(stream) {
  const reader = stream.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const frame = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of frame.split("\n")) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  }
}

function finishReply(li, userLi, reply, finish, extension, error) {
  const note = el("div", "note");
  li.append(note);
  if (error) {
    li.dataset.state = "error";
    note.append(el("span", "badge error", "Error: " + error));
    state.history.pop();   // the question goes again with the next message only if the user resends it
    return;
  }
  if (finish === "content_filter") {
    li.dataset.state = "blocked";
    li.classList.add("blocked");
    showVerdict(li, note, (extension && extension.blocked_by) || null);
    state.history.pop();   // a blocked exchange is not sent with later messages
    userLi.classList.add("left-out");
    return;
  }
  if (reply) state.history.push({ role: "assistant", content: reply });
  if (finish === "length") {
    li.dataset.state = "cut";
    note.append(el("span", "badge cut", "Cut at max_tokens: the reply did not finish"));
  } else if (finish === "stopped") {
    li.dataset.state = "stopped";
    note.append(el("span", "badge stopped", "Stopped"));
  } else {
    li.dataset.state = "done";
  }
}

function showVerdict(li, note, verdict) {
  li.querySelector(".who").textContent = "flashguard · blocked";
  const rail = verdict && verdict.rail === "input" ? "the input rail (your message)" :
    verdict && verdict.rail === "output" ? "the output rail (the model's reply)" : "a rail";
  note.classList.add("verdict");
  note.append(el("div", "verdict-title", "Blocked by " + rail));
  const dl = el("dl");
  const item = (k, v) => dl.append(el("dt", "", k), el("dd", "", v));
  if (verdict && typeof verdict.p_unsafe === "number") {
    item("why", "p_unsafe " + verdict.p_unsafe.toFixed(3) + " ≥ threshold " + verdict.threshold.toFixed(2));
    item("method", verdict.method + (verdict.strictness ? ", strictness " + verdict.strictness : ""));
  } else if (verdict && verdict.name) {
    item("rail", verdict.name);
  }
  item("kept", "this exchange is left out of the conversation");
  note.append(dl);
}

function reset() {
  if (state.controller) state.controller.abort();
  state.controller = null;
  state.turn++;
  state.history = [];
  $("log").replaceChildren();
  $("empty").hidden = false;
  setBusy(false);
  $("input").value = "";
  $("input").focus();
  refreshPanel();
}

// ---- the panel: bars drawn from /v1/flashguard/stats ------------------------------------------------------------
function size(bytes) {
  if (bytes >= 2 ** 30) return (bytes / 2 ** 30).toFixed(2) + " GiB";
  if (bytes < 2 ** 20) return Math.round(bytes / 2 ** 10) + " KiB";
  return (bytes / 2 ** 20).toFixed(bytes >= 10 * 2 ** 20 ? 0 : 1) + " MiB";
}

// A stacked bar of [label, value, class] parts over `total`, and its legend.
function bar(parts, total, format) {
  const box = el("div");
  const b = el("div", "bar");
  const legend = el("ul", "legend");
  for (const [label, value, cls] of parts) {
    const seg = el("span", cls);
    seg.style.width = total > 0 ? Math.min(100, (100 * value) / total) + "%" : "0";
    seg.title = label + ": " + format(value);
    b.append(seg);
    const row = el("li");
    row.append(el("span", "sw " + cls), el("span", "", label), el("span", "v", format(value)));
    legend.append(row);
  }
  box.append(b, legend);
  return box;
}

function drawMemory(engine) {
  const box = $("memory");
  box.replaceChildren();
  if (engine.gpu) {
    const cats = Object.entries(engine.gpu.categories);
    const total = engine.gpu.budget || engine.gpu.total;
    box.append(el("p", "muted", "GPU " + engine.device + ": " + size(cats.reduce((s, [, v]) => s + v, 0)) +
      " of " + size(total) + (engine.gpu.budget ? " (vram_budget)" : "")));
    box.append(bar(cats.map(([k, v], i) => [k, v, "c" + (i % 5)]), total, size));
  } else {
    box.append(el("p", "muted", "CPU: no GPU memory"));
  }
  const host = engine.host;
  box.append(el("p", "muted", "Host RAM of the engine: " + size(host.rss) + " of " + size(host.ram_total) +
    (engine.tokens.L3 ? "; L3 pages on disk: " + size(host.l3_disk) : "")));
  box.append(bar(Object.entries(host.categories).map(([k, v], i) => [k, v, "c" + (i % 5)]), host.rss, size));
}

function drawTiers(tokens) {
  const box = $("tiers");
  box.replaceChildren();
  const names = { L1: "live session (sinks + window)", L2: "pages in RAM", L3: "pages on disk" };
  const top = Math.max(1, tokens.L1, tokens.L2, tokens.L3);
  for (const tier of ["L1", "L2", "L3"]) {
    const row = el("div", "row");
    row.title = tier + ": " + names[tier];
    const b = el("div", "bar");
    const seg = el("span", "c" + ["L1", "L2", "L3"].indexOf(tier));
    seg.style.width = (100 * tokens[tier]) / top + "%";
    b.append(seg);
    row.append(el("strong", "", tier), b, el("span", "v", tokens[tier] + " tok"));
    box.append(row);
  }
  box.append(el("p", "muted", "L1 the live session, L2 pages in RAM, L3 pages on disk (a page may be in two)."));
}

function drawRails(turn) {
  const box = $("rails");
  box.replaceChildren();
  if (!turn || !turn.rails || !turn.rails.length) {
    box.append(el("p", "muted", turn ? "No rail verdict in the last turn." : "No turn yet."));
    return;
  }
  let reused = 0, all = 0;
  for (const v of turn.rails) {
    const r = v.reused_tokens || 0, p = v.prefilled_tokens || 0;
    reused += r; all += r + p;
    const div = el("div", "rail" + (v.blocked ? " blocked" : ""));
    const why = "p_unsafe " + Number(v.p_unsafe).toFixed(2) + (v.blocked ? " ≥ " : " < ") + "threshold " +
      Number(v.threshold).toFixed(2) + " (" + v.method + ")";
    div.append(el("strong", "", v.rail + " rail: " + (v.blocked ? "blocked" : "allowed")), el("div", "muted", why),
      bar([["reused", r, "reused"], ["prefilled", p, "prefilled"]], r + p, (n) => n + " tok"));
    box.append(div);
  }
  box.append(el("p", "muted", "The rails reused " + reused + " of " + all + " tokens" +
    (all ? " (" + Math.round((100 * reused) / all) + "%)" : "") + " instead of prefilling them."));
}

async function refreshPanel() {
  try {
    const res = await fetch("/v1/flashguard/stats");
    const stats = await res.json();
    const engine = (stats.engines || [])[0];
    if (engine) {
      $("model").textContent = engine.model + " · " + engine.device;
      drawMemory(engine);
      drawTiers(engine.tokens);
    } else {
      $("model").textContent = "no local engine (a remote backend serves the model)";
      $("memory").replaceChildren(el("p", "muted", "No local engine in this server."));
      $("tiers").replaceChildren();
    }
    drawRails(stats.last_turn);
  } catch (e) {
    $("model").textContent = "the engine's figures are unavailable: " + e.message;
  }
}

// ---- keys -------------------------------------------------------------------------------------------------------
$("composer").addEventListener("submit", (e) => { e.preventDefault(); send(); });
$("input").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); send(); }
});
document.addEventListener("keydown", (e) => {
  if (e.key === "Escape" && state.controller) { e.preventDefault(); state.controller.abort(); }
});
$("stop").addEventListener("click", () => state.controller && state.controller.abort());
$("reset").addEventListener("click", reset);
refreshPanel();
