// The chat page: talks to this server's own OpenAI-compatible API (same origin only), streams
// replies, renders them as Markdown, and shows each reply's stats from `mtplx_stats`.
"use strict";

const $ = (id) => document.getElementById(id);
const state = { key: sessionStorage.getItem("mtplx-key") || "", messages: [], controller: null,
                session: newSessionId() };

function newSessionId() {
  return "web-" + Math.random().toString(36).slice(2, 10);
}

function headers() {
  const h = { "Content-Type": "application/json", "x-session-id": state.session };
  if (state.key) h["Authorization"] = "Bearer " + state.key;
  return h;
}

async function loadModels() {
  const answer = await fetch("/v1/models", { headers: headers() });
  if (answer.status === 401) {
    $("key-form").hidden = false;
    $("key-error").textContent = state.key ? "that key was refused" : "";
    return;
  }
  $("key-form").hidden = true;
  const body = await answer.json();
  const select = $("model");
  select.innerHTML = "";
  for (const model of body.data || []) {
    const option = document.createElement("option");
    option.value = model.id;
    option.textContent = model.id;
    option.dataset.context = model.context_length || "";
    option.dataset.modelContext = (model.mtplx && model.mtplx.model_context_length) || "";
    option.dataset.limitedBy = (model.mtplx && model.mtplx.context_limited_by) || "";
    select.appendChild(option);
  }
  if (!select.options.length) {
    $("context").textContent = "no model loaded: `mtplxctl start` loads one";
    return;
  }
  showContext();
}

function showContext() {
  const option = $("model").selectedOptions[0];
  if (!option) return;
  const served = Number(option.dataset.context || 0);
  const own = Number(option.dataset.modelContext || 0);
  let text = served ? "context " + served.toLocaleString("en-US") + " tokens (this server's cap" : "";
  if (text && own && own !== served) {
    text += "; the model's own is " + own.toLocaleString("en-US");
    if (option.dataset.limitedBy) text += ", limited by " + option.dataset.limitedBy;
  }
  $("context").textContent = text ? text + ")" : "";
}

function addMessage(role) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  $("log").appendChild(div);
  return div;
}

function replyView(div) {
  const reasoning = document.createElement("details");
  reasoning.className = "reasoning";
  reasoning.hidden = true;
  reasoning.innerHTML = "<summary>Reasoning</summary><div class=\"text\"></div>";
  const content = document.createElement("div");
  content.className = "content";
  const stats = document.createElement("div");
  stats.className = "stats";
  div.append(reasoning, content, stats);
  return { reasoning, content, stats, text: "", thinking: "" };
}

function showStats(view, s) {
  const parts = [];
  if (s.decode_tokens_per_second) parts.push(s.decode_tokens_per_second.toFixed(1) + " tok/s");
  if (s.depth) parts.push("accepted " + Number(s.mean_accepted_length).toFixed(2) + " per cycle");
  else parts.push("plain AR");
  if (s.ttft_seconds !== undefined) parts.push("TTFT " + Number(s.ttft_seconds).toFixed(2) + " s");
  parts.push("cache " + s.cached_tokens + "/" + s.prompt_tokens + " prompt tokens");
  parts.push(s.completion_tokens + " tokens");
  view.stats.textContent = parts.join(" · ");
  view.stats.dataset.done = "1";
}

function showError(view, message) {
  const p = document.createElement("div");
  p.className = "error";
  p.textContent = message;
  view.content.after(p);
}

async function readEvents(answer, onData) {
  const reader = answer.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const frame = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of frame.split("\n")) {
        if (line.startsWith("data: ") && line !== "data: [DONE]") onData(JSON.parse(line.slice(6)));
      }
    }
  }
}

async function send(text) {
  state.messages.push({ role: "user", content: text });
  addMessage("user").textContent = text;
  const view = replyView(addMessage("assistant"));
  state.controller = new AbortController();
  setBusy(true);
  try {
    const answer = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), signal: state.controller.signal,
      body: JSON.stringify({ model: $("model").value || undefined, messages: state.messages,
                             stream: true, stream_options: { include_usage: true } }),
    });
    if (!answer.ok) {
      const body = await answer.json().catch(() => ({}));
      showError(view, (body.error && body.error.message) || ("HTTP " + answer.status));
      if (answer.status === 401) loadModels();
      state.messages.pop();
      return;
    }
    await readEvents(answer, (data) => {
      if (data.error) { showError(view, data.error.message); return; }
      const delta = (data.choices && data.choices[0] && data.choices[0].delta) || {};
      if (delta.reasoning_content) {
        view.thinking += delta.reasoning_content;
        view.reasoning.hidden = false;
        view.reasoning.querySelector(".text").textContent = view.thinking;
      }
      if (delta.content) {
        view.text += delta.content;
        view.content.innerHTML = renderMarkdown(view.text);
        $("log").scrollTop = $("log").scrollHeight;
      }
      if (data.mtplx_stats) showStats(view, data.mtplx_stats);
    });
  } catch (err) {
    if (err.name === "AbortError") view.stats.textContent = "stopped";
    else showError(view, String(err));
  } finally {
    state.messages.push({ role: "assistant", content: view.text });
    state.controller = null;
    setBusy(false);
  }
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
}

$("compose").addEventListener("submit", (event) => {
  event.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || state.controller) return;
  $("prompt").value = "";
  send(text);
});
$("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) {
    event.preventDefault();
    $("compose").requestSubmit();
  }
});
$("stop").addEventListener("click", () => state.controller && state.controller.abort());
$("new-chat").addEventListener("click", () => {
  if (state.controller) state.controller.abort();
  state.messages = [];
  state.session = newSessionId();
  $("log").innerHTML = "";
});
$("model").addEventListener("change", showContext);
$("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  state.key = $("key").value.trim();
  sessionStorage.setItem("mtplx-key", state.key);
  loadModels();
});
loadModels();
