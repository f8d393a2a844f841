// aserve playground: chat and completion against this server's OpenAI routes, and live engine charts.
// Plain browser JavaScript, no build step. Every URL is relative to the page, so it works under --root-path.
// The API key lives in sessionStorage (gone with the tab) and only ever goes into the Authorization header.
"use strict";

const $ = (id) => document.getElementById(id);
const KEY_STORAGE = "aserve.apiKey";
const SAMPLE_MS = 1000;   // how often the engine panel reads /metrics
const WINDOW = 300;       // samples kept: the last 5 minutes

const session = { history: [], controller: null };

// ---- talking to the server ------------------------------------------------------------------

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) h.Authorization = "Bearer " + key;
  return h;
}

// The server's own words for a failed request (OpenAI's error shape), else the status line.
async function errorText(response) {
  const text = await response.text();
  try {
    const message = JSON.parse(text).error.message;
    if (message) return `${response.status}: ${message}`;
  } catch (_) { /* not JSON: fall through */ }
  return `${response.status} ${response.statusText} ${text.slice(0, 200)}`.trim();
}

// The JSON payloads of an SSE response's `data:` events, until `data: [DONE]`.
async function* sseEvents(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value.replace(/\r\n/g, "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const data = buffer.slice(0, end).split("\n").filter((l) => l.startsWith("data:"))
        .map((l) => l.slice(5).trim()).join("\n");
      buffer = buffer.slice(end + 2);
      if (data === "[DONE]") return;
      if (data) yield JSON.parse(data);
    }
  }
}

// The served model's name in the header, and a picker of it and its LoRA adapters when it serves any; asked at
// load and when the key changes, so a wrong key shows at once.
async function loadModel() {
  try {
    const response = await fetch("v1/models", { headers: headers() });
    if (!response.ok) return showError(await errorText(response));
    const models = (await response.json()).data;
    $("model-name").textContent = models[0].id;
    const picker = $("model"), chosen = picker.value;
    picker.replaceChildren(...models.map((m) => new Option(m.parent ? `${m.id} (LoRA)` : m.id, m.id)));
    if (models.some((m) => m.id === chosen)) picker.value = chosen;
    picker.hidden = models.length < 2;
    showError("");
  } catch (err) {
    showError(`cannot reach the server: ${err.message}`);
  }
}

function showError(message) {
  $("error").textContent = message;
  $("error").hidden = !message;
}

// ---- the request a send makes ---------------------------------------------------------------

function mode() { return document.querySelector("input[name=mode]:checked").value; }

function numberField(id) {
  const text = $(id).value.trim();
  return text === "" ? undefined : Number(text);
}

// The request body from the settings panel; throws with a readable message on a bad JSON schema.
function requestBody(input) {
  const logprobs = $("logprobs").checked;
  const body = {
    stream: true, stream_options: { include_usage: true, continuous_usage_stats: true },
    temperature: numberField("temperature"), top_p: numberField("top_p"), top_k: numberField("top_k"),
    max_tokens: numberField("max_tokens"), seed: numberField("seed"), n: numberField("n"),
    ignore_eos: $("ignore_eos").checked,
  };
  if (!$("model").hidden) body.model = $("model").value;
  const stops = $("stop-strings").value.split("\n").filter((s) => s !== "");
  if (stops.length) body.stop = stops;
  const schemaText = $("schema").value.trim();
  if (schemaText) {
    let schema;
    try { schema = JSON.parse(schemaText); } catch (err) { throw new Error(`JSON schema: ${err.message}`); }
    body.response_format = { type: "json_schema", json_schema: { name: "playground", schema } };
  }
  if (mode() === "chat") {
    const system = $("system").value.trim();
    body.messages = [...(system ? [{ role: "system", content: system }] : []), ...session.history, input];
    if (logprobs) Object.assign(body, { logprobs: true, top_logprobs: 5 });
  } else {
    body.prompt = input.content;
    if (logprobs) body.logprobs = 5;
  }
  return body;
}

// ---- the message list -----------------------------------------------------------------------

function addMessage(role, text) {
  const article = document.createElement("article");
  article.className = `message ${role}`;
  const heading = document.createElement("h3");
  heading.textContent = role;
  article.append(heading);
  if (text !== undefined) {
    const div = document.createElement("div");
    div.className = "text";
    div.textContent = text;
    article.append(div);
  }
  $("messages").append(article);
  $("messages").scrollTop = $("messages").scrollHeight;
  return article;
}

// Keep the newest text in view, unless the reader has scrolled up to read something earlier.
function following(change) {
  const box = $("messages");
  const atEnd = box.scrollHeight - box.scrollTop - box.clientHeight < 40;
  change();
  if (atEnd) box.scrollTop = box.scrollHeight;
}

// One output message being streamed: a text box per choice (n > 1), and a stats line.
class Reply {
  constructor(role) {
    this.article = addMessage(role);
    this.choices = [];
    this.stats = document.createElement("p");
    this.stats.className = "stats";
    this.article.append(this.stats);
    this.started = performance.now();
    this.firstAt = this.lastAt = null;
    this.tokens = 0;
  }

  choice(index) {
    if (!this.choices[index]) {
      const div = document.createElement("div");
      div.className = "text";
      div.dataset.index = index;
      this.article.insertBefore(div, this.stats);
      this.choices[index] = { div, text: "", finish: null };
    }
    return this.choices[index];
  }

  // Text of one chunk; with logprobs, one hoverable span per token.
  append(index, text, tokens) {
    const c = this.choice(index);
    c.text += text;
    following(() => (tokens ? c.div.append(...tokens.map(tokenSpan)) : c.div.append(text)));
    if (text || tokens?.length) {
      this.lastAt = performance.now();
      this.firstAt = this.firstAt ?? this.lastAt;
    }
  }

  update(usage, finishReason) {
    if (usage) this.tokens = usage.completion_tokens;
    // TTFT from the send; tokens/s over decoding (first token to last), as llama.cpp's page counts it
    const ttft = this.firstAt === null ? "–" : Math.round(this.firstAt - this.started) + " ms";
    const decode = this.lastAt - this.firstAt;
    const rate = this.tokens > 1 && decode > 0 ? ((this.tokens - 1) * 1000 / decode).toFixed(1) : "–";
    const finishes = this.choices.map((c) => c.finish).filter(Boolean);
    if (finishReason) this.article.dataset.finish = finishReason;
    this.stats.textContent = [`${this.tokens} tokens`, `TTFT ${ttft}`,
      `${rate} tokens/s`, `finish: ${finishReason || finishes.join(", ") || "…"}`].join(" · ");
  }
}

// A token with its logprob and the alternatives in a tooltip; the tint shows how likely it was.
function tokenSpan({ token, logprob, top }) {
  const span = document.createElement("span");
  span.className = "token";
  span.textContent = token;
  const p = Math.exp(logprob);
  span.style.setProperty("--p", p.toFixed(3));
  const alternatives = top.map(([t, lp]) => `${JSON.stringify(t)} ${lp.toFixed(3)}`).join("\n");
  span.title = `${JSON.stringify(token)} logprob ${logprob.toFixed(3)} (p ${(100 * p).toFixed(1)}%)\n${alternatives}`;
  return span;
}

// Per-token logprobs of a chunk choice, in one shape for both routes.
function chunkTokens(choice) {
  const lp = choice.logprobs;
  if (!lp) return null;
  if (lp.content) {  // chat
    return lp.content.map((t) => ({ token: t.token, logprob: t.logprob,
      top: t.top_logprobs.map((x) => [x.token, x.logprob]) }));
  }
  return lp.tokens.map((token, i) => ({ token, logprob: lp.token_logprobs[i],
    top: Object.entries(lp.top_logprobs[i] || {}) }));
}

// ---- send and stop --------------------------------------------------------------------------

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
}

async function send(event) {
  event.preventDefault();
  const text = $("prompt").value;
  if (session.controller || !text.trim()) return;
  const input = { role: "user", content: text };
  let body;
  try { body = requestBody(input); } catch (err) { return showError(err.message); }
  showError("");
  $("prompt").value = "";
  const isChat = mode() === "chat";
  addMessage(isChat ? "user" : "prompt", text);
  const reply = new Reply(isChat ? "assistant" : "completion");
  session.controller = new AbortController();
  setBusy(true);
  let finish = null;
  try {
    const response = await fetch(isChat ? "v1/chat/completions" : "v1/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(body), signal: session.controller.signal });
    if (!response.ok) throw new Error(await errorText(response));
    for await (const chunk of sseEvents(response)) {
      if (chunk.error) throw new Error(`${chunk.error.code}: ${chunk.error.message}`);
      for (const c of chunk.choices) {
        reply.append(c.index, (isChat ? c.delta.content : c.text) || "", chunkTokens(c));
        if (c.finish_reason) reply.choice(c.index).finish = c.finish_reason;
      }
      reply.update(chunk.usage);
    }
    finish = reply.choices.map((c) => c.finish).join(", ");
  } catch (err) {
    if (err.name === "AbortError") finish = "stopped";
    else { finish = "error"; showError(err.message); }
  } finally {
    reply.update(null, finish);
    session.controller = null;
    setBusy(false);
  }
  if (isChat && reply.choices.length) {  // the conversation goes on from the first choice (stopped or not)
    session.history.push(input, { role: "assistant", content: reply.choices[0].text });
  }
}

function stop() {
  if (session.controller) session.controller.abort();  // closing the connection aborts the request on the server
}

// ---- the engine panel: small SVG line charts fed by /metrics ---------------------------------

const SVG = "http://www.w3.org/2000/svg";

class Chart {
  // One line per label; `fixedMax` is the top of the y range (null: follow the data); `format` writes a value.
  constructor(id, title, labels, fixedMax = null, format = (v) => String(v)) {
    Object.assign(this, { figure: $(id), labels, fixedMax, format, samples: [] });
    this.caption = document.createElement("figcaption");
    this.title = document.createElement("strong");
    this.title.textContent = title;
    const plot = document.createElement("div");
    plot.className = "plot";
    this.svg = document.createElementNS(SVG, "svg");
    this.svg.setAttribute("viewBox", "0 0 300 60");
    this.svg.setAttribute("preserveAspectRatio", "none");
    this.svg.setAttribute("aria-hidden", "true");
    this.lines = labels.map((_, i) => {
      const line = document.createElementNS(SVG, "polyline");
      line.setAttribute("class", `series s${i}`);
      this.svg.append(line);
      return line;
    });
    this.scale = document.createElement("span");  // the y range's top, and how far back the x axis goes
    this.scale.className = "scale";
    plot.append(this.svg, this.scale);
    this.figure.append(this.caption, plot);
  }

  push(values) {
    this.samples.push(values);
    if (this.samples.length > WINDOW) this.samples.shift();
    const all = this.samples.flat();
    const top = this.fixedMax ?? niceCeil(Math.max(1, ...all));
    const span = Math.max(60, this.samples.length);  // fill the width over the first minute, then up to WINDOW
    const x = (i) => (300 * (span - this.samples.length + i) / (span - 1)).toFixed(1);
    const y = (v) => (58 - 56 * Math.min(v, top) / top).toFixed(1);
    this.lines.forEach((line, s) => line.setAttribute("points",
      this.samples.map((v, i) => `${x(i)},${y(v[s])}`).join(" ")));
    this.scale.textContent = `top ${this.format(top)} · last ${Math.round(span * SAMPLE_MS / 1000)} s`;
    this.caption.replaceChildren(this.title, ...this.labels.map((label, i) => {
      const value = document.createElement("span");
      value.className = `k${i}`;  // coloured like its line
      value.textContent = `${label} ${this.format(values[i])}`;
      return value;
    }));
    this.figure.dataset.points = this.samples.length;
    this.figure.dataset.max = Math.max(...all);
  }
}

// 1, 2 or 5 times a power of ten, at least `v`: a y range that reads well.
function niceCeil(v) {
  const p = 10 ** Math.floor(Math.log10(v));
  return [1, 2, 5, 10].map((m) => m * p).find((n) => n >= v);
}

// Each metric's samples in Prometheus' text format, summed over their labels (model_name, or a replica label
// where several engines serve): `sum(name)`, and `mean(name)` for a fraction such as the KV cache usage.
function parseMetrics(text) {
  const totals = {}, counts = {};
  for (const line of text.split("\n")) {
    const m = line.match(/^([a-zA-Z_:][\w:]*)(?:\{.*\})?\s+(\S+)/);
    if (m) {
      totals[m[1]] = (totals[m[1]] || 0) + Number(m[2]);
      counts[m[1]] = (counts[m[1]] || 0) + 1;
    }
  }
  return { sum: (name) => totals[name] || 0, mean: (name) => (counts[name] ? totals[name] / counts[name] : 0) };
}

function startEnginePanel() {
  const requests = new Chart("chart-requests", "Requests", ["running", "waiting", "swapped"]);
  const kv = new Chart("chart-kv", "KV cache", ["used"], 100, (v) => +v.toFixed(1) + "%");
  const tokens = new Chart("chart-tokens", "Tokens/s", ["generated", "prompt"], null, (v) => v.toFixed(0));
  const counted = [];  // the token counters' recent readings: rates over a few seconds read steadier than per second
  async function sample() {
    try {
      const response = await fetch("metrics");
      if (!response.ok) throw new Error(await errorText(response));
      const m = parseMetrics(await response.text());
      const at = performance.now();
      const counts = [m.sum("aserve:generation_tokens_total"), m.sum("aserve:prompt_tokens_total")];
      counted.push({ at, counts });
      if (counted.length > 4) counted.shift();
      const then = counted[0];
      const rates = counts.map((c, i) => (at > then.at ? Math.max(0, c - then.counts[i]) * 1000 / (at - then.at) : 0));
      requests.push([m.sum("aserve:num_requests_running"), m.sum("aserve:num_requests_waiting"),
        m.sum("aserve:num_requests_swapped")]);
      kv.push([100 * m.mean("aserve:kv_cache_usage_perc")]);
      tokens.push(rates);
      $("engine-status").textContent = "";
    } catch (err) {
      $("engine-status").textContent = `(metrics unavailable: ${err.message})`;
    }
    setTimeout(sample, SAMPLE_MS);
  }
  sample();
}

// ---- wiring ---------------------------------------------------------------------------------

function applyMode() {
  const isChat = mode() === "chat";
  $("system-field").hidden = !isChat;
  $("prompt").placeholder = isChat ? "Message: Enter sends, Shift+Enter adds a line"
    : "Prompt to continue: Enter sends, Shift+Enter adds a line";
}

function clear() {
  stop();
  session.history = [];
  $("messages").replaceChildren();
  showError("");
}

document.addEventListener("DOMContentLoaded", () => {
  $("api-key").value = sessionStorage.getItem(KEY_STORAGE) || "";
  $("api-key").addEventListener("change", () => {
    sessionStorage.setItem(KEY_STORAGE, $("api-key").value.trim());
    loadModel();
  });
  $("composer").addEventListener("submit", send);
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stop").addEventListener("click", stop);
  $("clear").addEventListener("click", clear);
  for (const radio of document.querySelectorAll("input[name=mode]")) {
    radio.addEventListener("change", () => { clear(); applyMode(); });
  }
  applyMode();
  loadModel();
  startEnginePanel();
});
