// The chat page: model picker + status stream, chat with branches, conversations, settings,
// the models page. Plain DOM, no framework; state lives in `S` and the render* functions draw it.
import * as api from "./api.js";
import * as db from "./db.js";
import { copyText, renderMarkdown } from "./markdown.js";
import * as speech from "./speech.js";

const $ = (sel, root = document) => root.querySelector(sel);
const h = (tag, props = {}, ...kids) => {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(props)) {
    if (k === "class") el.className = v;
    else if (k === "text") el.textContent = v;
    else if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else if (k === "dataset") Object.assign(el.dataset, v);
    else if (v !== undefined && v !== null && v !== false) el.setAttribute(k, v === true ? "" : v);
  }
  el.append(...kids.filter((x) => x !== null && x !== undefined && x !== false));
  return el;
};

const PARAMS = ["temperature", "top_p", "top_k", "min_p", "max_tokens", "seed", "presence_penalty",
                "frequency_penalty", "repeat_penalty"];
const SETTINGS_KEY = "omni.settings";
const MODEL_KEY = "omni.model";
const TEXT_LIMIT = 512 * 1024;

const S = {
  models: new Map(),   // id -> card from /v1/models (status kept fresh by /models/sse)
  canManage: true,     // false once the key was refused a load/unload/sleep (403): a user key
  routerProps: null,
  selected: null,      // model id
  modelProps: new Map(), // id -> worker /props (defaults, modalities)
  conv: null,          // the open conversation
  convs: [],
  search: "",
  busy: null,          // {controller, node} while generating
  attachments: [],     // [{name, kind: "text"|"image"|"video", data}]
  settings: loadSettings(),
  view: "chat",
};

function loadSettings() {
  try { return { theme: "system", ...JSON.parse(localStorage.getItem(SETTINGS_KEY) || "{}") }; } catch { return { theme: "system" }; }
}

function toast(msg, ms = 4000) {
  const t = $("#toast");
  t.textContent = msg;
  t.hidden = false;
  clearTimeout(toast.timer);
  toast.timer = setTimeout(() => { t.hidden = true; }, ms);
}

function handleError(e) {
  if (e instanceof api.AuthError) askKey(e);
  else if (e?.name !== "AbortError") toast(String(e.message || e));
}

// ------------------------------------------------------------------ theme

function applyTheme() {
  const t = S.settings.theme || "system";
  const dark = t === "dark" || (t === "system" && matchMedia("(prefers-color-scheme: dark)").matches);
  document.documentElement.dataset.theme = dark ? "dark" : "light";
  $("#hljs-light").disabled = dark;
  $("#hljs-dark").disabled = !dark;
}
matchMedia("(prefers-color-scheme: dark)").addEventListener("change", applyTheme);

// ------------------------------------------------------------------ models

const GROUPS = [["Loaded", ["loaded"]], ["Sleeping", ["sleeping"]], ["Loading", ["downloading", "loading", "stopping"]],
                ["Available", ["unloaded"]], ["Failed", ["failed"]]];
const stateOf = (card) => card?.status?.value || "unloaded";

async function refreshModels() {
  try {
    const list = await api.getModels();
    S.models = new Map(list.map((m) => [m.id, m]));
    if (!S.selected || !S.models.has(S.selected)) {
      const remembered = localStorage.getItem(MODEL_KEY);
      const loaded = list.filter((m) => stateOf(m) === "loaded");
      S.selected = list.length === 1 ? list[0].id
        : S.models.has(remembered) ? remembered
        : loaded.length === 1 ? loaded[0].id : null;  // the one model already loaded
    }
    renderModels();
    api.getProps().then((p) => { S.routerProps = p; renderModelsPage(); }).catch(() => {});
  } catch (e) { handleError(e); }
}

function onStatus(model, status) {
  for (const c of S.models.values()) if (c.variant_of === model) c.status = status;  // a variant: its base's state
  const card = S.models.get(model);
  if (!card) { refreshModels(); return; }
  const was = stateOf(card);
  card.status = status;
  if (S.busy && S.busy.node.model === model) renderStreaming(S.busy.node);  // the spinner's line
  if (was !== "loaded" && status.value === "loaded") {
    api.getModels().then((list) => { for (const m of list) S.models.set(m.id, m); renderModels(); }).catch(() => {});
    S.modelProps.delete(model);
    if (model === S.selected) fetchModelProps(model);
  }
  renderModels();
}

async function fetchModelProps(model) {
  if (!model || S.modelProps.has(model) || stateOf(S.models.get(model)) !== "loaded") return;
  try {
    S.modelProps.set(model, await api.getProps(model));
    renderSettingsPlaceholders();
    renderAttachHint();
  } catch { /* not loaded after all */ }
}

function selectModel(id, { load = true } = {}) {
  S.selected = id;
  localStorage.setItem(MODEL_KEY, id);
  closeMenu();
  const st = stateOf(S.models.get(id));
  if (load && S.canManage && (st === "unloaded" || st === "failed")) doModel("load", id, { quiet: true });
  fetchModelProps(id);
  renderModels();
}

// Keys (router/keys): a user key may chat with its models but not load, unload or sleep them
// (403). The first 403 hides those buttons; a model picked then loads with the first message.
async function doModel(action, id, { quiet = false } = {}) {
  try {
    await { load: api.loadModel, unload: api.unloadModel, sleep: api.sleepModel }[action](id);
  } catch (e) {
    if (e instanceof api.ForbiddenError) {
      S.canManage = false;
      renderModels();
      renderModelsPage();
      if (!quiet) toast(`${e.message} (this key can chat; models load when a message needs them)`);
    } else handleError(e);
  }
}

function statusBadge(card) {
  const st = stateOf(card);
  return h("span", { class: `badge st-${st}`, text: st });
}

function progressBar(card) {
  const p = card.status?.progress;
  if (stateOf(card) === "downloading") return bytesBar(p?.bytes_done || 0, p?.bytes_total || 0, "downloading");
  if (stateOf(card) !== "loading") return null;
  const frac = typeof p?.fraction === "number" ? Math.max(0, Math.min(1, p.fraction)) : null;
  const bar = h("div", { class: "progress", role: "progressbar", "aria-valuemin": "0", "aria-valuemax": "100",
                          "aria-valuenow": frac === null ? undefined : String(Math.round(frac * 100)) },
                h("div", { class: frac === null ? "fill indeterminate" : "fill" }));
  if (frac !== null) bar.firstChild.style.width = `${(frac * 100).toFixed(0)}%`;
  return h("div", { class: "progress-wrap" }, bar, h("span", { class: "muted small", text: p?.phase || "loading" }));
}

function failure(card) {
  const st = card.status || {};
  if (stateOf(card) !== "failed") return null;
  const tail = (st.log_tail || []).join("\n");
  return h("div", { class: "model-error" },
    h("div", { class: "error clamp", title: st.error || "", text: failureLine(st) }),
    tail ? h("details", {}, h("summary", { text: "log tail" }), h("pre", { class: "log-tail", text: tail })) : null);
}

function failureLine(st) {
  const msg = st.error || "failed";
  const code = st.exit_code ?? null;
  return code === null || msg.includes(`exit code ${code}`) ? msg : `${msg} (exit code ${code})`;
}

function modelButtons(card, withSleep = false) {
  if (!S.canManage) return null;  // a user key (see doModel)
  const st = stateOf(card);
  const b = (label, action, cls = "") => h("button", { class: `btn small ${cls}`, type: "button", dataset: { action },
    onclick: (ev) => { ev.stopPropagation(); doModel(action, card.id); } , text: label });
  return h("span", { class: "model-actions" },
    ["unloaded", "failed"].includes(st) ? b("Load", "load", "primary") : null,
    withSleep && st === "loaded" ? b("Sleep", "sleep") : null,
    ["loaded", "sleeping"].includes(st) ? b("Unload", "unload") : null,
    st === "loading" ? b("Cancel", "unload") : null);  // (unload stops a load where it is)
}

function renderModels() {
  const card = S.models.get(S.selected);
  $("#model-name").textContent = card ? card.id : (S.models.size ? "Select a model" : "No models");
  $("#model-dot").className = `dot st-${stateOf(card)}`;
  $("#model-button").dataset.state = card ? stateOf(card) : "";
  const menu = $("#model-menu");
  menu.replaceChildren();
  for (const [title, states] of GROUPS) {
    const cards = [...S.models.values()].filter((m) => states.includes(stateOf(m)));
    if (!cards.length) continue;
    menu.append(h("div", { class: "group-title", text: title }));
    for (const m of cards) {
      menu.append(h("div", { class: `model-item${m.id === S.selected ? " selected" : ""}`, role: "option",
                             tabindex: "0", dataset: { model: m.id, state: stateOf(m) },
                             onclick: () => selectModel(m.id),
                             onkeydown: (ev) => { if (ev.key === "Enter") selectModel(m.id); } },
        h("div", { class: "model-line" }, h("span", { class: "model-id", text: m.id }),
          m.aliases?.length ? h("span", { class: "muted small", text: m.aliases.join(", ") }) : null,
          h("span", { class: "spacer" }), statusBadge(m), modelButtons(m)),
        progressBar(m), failure(m)));
    }
  }
  renderModelsPage();
  renderComposerState();
  speech.renderToggle(S.models, S.selected);
}

function openMenu() { $("#model-menu").hidden = false; $("#model-button").setAttribute("aria-expanded", "true"); }
function closeMenu() { $("#model-menu").hidden = true; $("#model-button").setAttribute("aria-expanded", "false"); }

function fmtBytes(n) {
  if (typeof n !== "number") return "";
  const u = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < u.length - 1) { n /= 1024; i += 1; }
  return `${n.toFixed(i ? 1 : 0)} ${u[i]}`;
}

function memoryOf(card) {
  const m = card.memory ?? card.meta?.memory ?? card.status?.memory;
  if (typeof m === "number") return fmtBytes(m);
  if (m && typeof m === "object") {  // the router's: measured (null when not running) and the estimate
    const parts = [];
    if (typeof m.ram_bytes === "number") parts.push(`${fmtBytes(m.ram_bytes)} RAM`);
    if (typeof m.vram_bytes === "number" && m.vram_bytes > 0) parts.push(`${fmtBytes(m.vram_bytes)} VRAM`);
    if (typeof m.estimated_bytes === "number") parts.push(`${parts.length ? "est. " : "needs ~"}${fmtBytes(m.estimated_bytes)}`);
    return parts.length ? parts.join(" · ") : "—";
  }
  const size = card.meta?.size ?? card.meta?.n_bytes;
  return typeof size === "number" ? `weights ${fmtBytes(size)}` : "—";
}

// GPU placement (docs/gpu-placement.md): the devices a model runs on, from its card's `devices`
function devicesOf(card) {
  const devs = card.devices || [];
  if (!devs.length || ["unloaded", "failed"].includes(stateOf(card))) return null;  // (a stale card's)
  const text = devs.map((d) => `GPU ${d.index}${typeof d.vram_bytes === "number" ? ` ${fmtBytes(d.vram_bytes)}` : ""}`).join(" · ");
  return h("div", { class: "muted small devices", text, title: devs.map((d) => `GPU ${d.index}: ${d.name || "?"} (${d.uuid || "?"})`).join("\n") });
}

function renderModelsPage() {
  const p = S.routerProps;
  $("#router-info").textContent = p ? `models_max ${p.models_max ?? "∞"} · autoload ${p.models_autoload ? "on" : "off"}` : "";
  const rows = [...S.models.values()].map((m) => h("tr", { dataset: { model: m.id, state: stateOf(m) } },
    h("td", {}, h("strong", { text: m.id }), m.pinned ? h("span", { class: "badge", text: "pinned" }) : null,
      m.path || m.upstream ? h("div", { class: "muted small path", text: m.path || m.upstream }) : null,
      m.node ? h("div", { class: "muted small node", text: `Ray node ${m.node.name}`, title: m.node.id }) : null,
      devicesOf(m)),
    h("td", {}, statusBadge(m), progressBar(m)),
    h("td", { text: m.resolved_backend || m.backend || "", title: m.backend === "auto" ? "backend = auto" : "" }),
    h("td", { text: (m.aliases || []).join(", ") || "—" }),
    h("td", { text: memoryOf(m) }),
    h("td", { class: "num", text: String(m.in_flight ?? 0) }),
    h("td", {}, modelButtons(m, true))));
  const failed = [...S.models.values()].filter((m) => stateOf(m) === "failed").map((m) =>
    h("div", { class: "failed-card", dataset: { model: m.id } }, h("h3", { text: `${m.id}: failed` }),
      h("div", { class: "error", text: failureLine(m.status) }),
      h("pre", { class: "log-tail", text: (m.status.log_tail || []).join("\n") || "(no log)" })));
  $("#models-table").replaceChildren(
    h("div", { class: "table-wrap" }, h("table", { class: "models" },
      h("thead", {}, h("tr", {}, ...["Model", "State", "Backend", "Aliases", "Memory", "In flight", ""].map((t) => h("th", { text: t })))),
      h("tbody", {}, ...rows))), ...failed);
}

// ------------------------------------------------------------------ pulling a model (POST /models/pull)

function bytesBar(done, total, label) {
  const frac = total ? Math.max(0, Math.min(1, done / total)) : null;
  const bar = h("div", { class: "progress", role: "progressbar", "aria-valuemin": "0", "aria-valuemax": "100",
                          "aria-valuenow": frac === null ? undefined : String(Math.round(frac * 100)) },
                h("div", { class: frac === null ? "fill indeterminate" : "fill" }));
  if (frac !== null) bar.firstChild.style.width = `${(frac * 100).toFixed(0)}%`;
  const text = total ? `${label} ${fmtBytes(done)} / ${fmtBytes(total)}` : label;
  return h("div", { class: "progress-wrap" }, bar, h("span", { class: "muted small", text }));
}

async function pullRepo(ev) {
  ev.preventDefault();
  const repo = $("#pull-repo").value.trim();
  const out = $("#pull-progress");
  if (!repo) return;
  $("#pull-button").disabled = true;
  out.replaceChildren(bytesBar(0, 0, `pulling ${repo}`));
  try {
    for await (const line of api.pullModel(repo)) {
      if (line.error) throw new Error(line.error.message);
      if (line.status === "downloading") out.replaceChildren(bytesBar(line.bytes_done, line.bytes_total, `pulling ${repo}`));
      if (line.status === "success") {
        out.replaceChildren(h("span", { class: "muted small pull-done",
          text: `${line.model}: ${fmtBytes(line.bytes)} in the hub cache${line.served_as ? `, served as ${line.served_as}` : ""}` }));
        await refreshModels();
      }
    }
  } catch (e) {
    out.replaceChildren(h("span", { class: "error pull-error", text: e.message }));
    if (e instanceof api.AuthError) handleError(e);
  } finally {
    $("#pull-button").disabled = false;
  }
}

// ------------------------------------------------------------------ conversations

async function refreshConversations() {
  S.convs = await db.listConversations();
  renderConversations();
}

function matches(conv, q) {
  if (!q) return true;
  q = q.toLowerCase();
  return conv.name.toLowerCase().includes(q)
    || Object.values(conv.messages).some((m) => (m.content || "").toLowerCase().includes(q));
}

function renderConversations() {
  const list = $("#conversations");
  list.replaceChildren(...S.convs.filter((c) => matches(c, S.search)).map((c) =>
    h("li", { class: `conv-item${S.conv?.id === c.id ? " active" : ""}`, dataset: { id: c.id } },
      h("button", { class: "conv-open", type: "button", text: c.name, title: c.name, onclick: () => openConversation(c.id) }),
      h("button", { class: "btn icon small conv-rename", type: "button", title: "Rename", "aria-label": "Rename", text: "✎",
                   onclick: () => renameConversation(c.id) }),
      h("button", { class: "btn icon small conv-delete", type: "button", title: "Delete", "aria-label": "Delete", text: "×",
                   onclick: () => removeConversation(c.id) }))));
}

async function openConversation(id) {
  if (S.busy) stopGeneration();
  S.conv = (await db.getConversation(id)) || null;
  renderConversations();
  renderMessages();
  setView("chat");
  if (innerWidth < 800) document.body.classList.remove("sidebar-open");
}

async function renameConversation(id) {
  const conv = await db.getConversation(id);
  const name = prompt("Rename conversation", conv.name);
  if (!name) return;
  conv.name = name.trim().slice(0, 200);
  await db.putConversation(conv);
  if (S.conv?.id === id) S.conv.name = conv.name;
  refreshConversations();
}

async function removeConversation(id) {
  if (!confirm("Delete this conversation?")) return;
  await db.deleteConversation(id);
  if (S.conv?.id === id) { S.conv = null; renderMessages(); }
  refreshConversations();
}

function newChat() {
  if (S.busy) stopGeneration();
  S.conv = null;
  renderMessages();
  renderConversations();
  $("#input").focus();
}

async function exportAll() {
  const all = await db.listConversations();
  const blob = new Blob([JSON.stringify({ format: "omni-router-conversations", version: 1, conversations: all }, null, 2)],
                        { type: "application/json" });
  const a = h("a", { href: URL.createObjectURL(blob), download: `conversations-${new Date().toISOString().slice(0, 10)}.json` });
  document.body.append(a);
  a.click();
  a.remove();
}

async function importFile(file) {
  try {
    const data = JSON.parse(await file.text());
    const convs = Array.isArray(data) ? data : (data.conversations || [data]);
    let n = 0;
    for (const c of convs) {
      if (!db.isConversation(c)) continue;
      await db.putConversation(c);
      n += 1;
    }
    toast(`Imported ${n} conversation${n === 1 ? "" : "s"}`);
    refreshConversations();
  } catch (e) { toast(`Import failed: ${e.message}`); }
}

// ------------------------------------------------------------------ the message tree

function pathTo(conv, leafId) {
  const out = [];
  for (let id = leafId; id && id !== "root"; id = conv.messages[id]?.parent) out.unshift(conv.messages[id]);
  return out;
}

function deepestLeaf(conv, id) {
  let node = conv.messages[id];
  while (node.children.length) node = conv.messages[node.children[node.children.length - 1]];
  return node.id;
}

function addNode(conv, parentId, fields) {
  const node = { id: db.newId(), parent: parentId, children: [], created: Date.now(), content: "", ...fields };
  conv.messages[node.id] = node;
  conv.messages[parentId].children.push(node.id);
  conv.current = node.id;
  return node;
}

async function save(conv) {
  conv.updated = Date.now();
  await db.putConversation(conv);
  refreshConversations();
}

function switchSibling(nodeId, delta) {
  if (S.busy) return;
  const conv = S.conv;
  const sibs = conv.messages[conv.messages[nodeId].parent].children;
  const i = sibs.indexOf(nodeId) + delta;
  if (i < 0 || i >= sibs.length) return;
  conv.current = deepestLeaf(conv, sibs[i]);
  save(conv);
  renderMessages();
}

// ------------------------------------------------------------------ rendering messages

function fmtStats(stats) {
  if (!stats) return null;
  const parts = [];
  if (stats.prompt_tokens !== undefined) parts.push(["prompt", `${stats.prompt_tokens} tok`]);
  if (stats.completion_tokens !== undefined) parts.push(["generated", `${stats.completion_tokens} tok`]);
  if (stats.tokens_per_second) parts.push(["speed", `${stats.tokens_per_second.toFixed(1)} tok/s`]);
  if (stats.ttft_ms !== undefined) parts.push(["TTFT", `${Math.round(stats.ttft_ms)} ms`]);
  if (stats.stopped) parts.push(["", "stopped"]);
  return h("div", { class: "stats" }, ...parts.map(([k, v]) => h("span", { class: "stat", dataset: { k } }, k ? h("b", { text: k }) : null, ` ${v}`)));
}

function branchNav(node) {
  const sibs = S.conv.messages[node.parent].children;
  if (sibs.length < 2) return null;
  const i = sibs.indexOf(node.id);
  return h("span", { class: "branch-nav" },
    h("button", { class: "btn icon small prev", type: "button", title: "Previous version", "aria-label": "Previous version", text: "‹",
                 disabled: i === 0, onclick: () => switchSibling(node.id, -1) }),
    h("span", { class: "branch-pos", text: `${i + 1}/${sibs.length}` }),
    h("button", { class: "btn icon small next", type: "button", title: "Next version", "aria-label": "Next version", text: "›",
                 disabled: i === sibs.length - 1, onclick: () => switchSibling(node.id, 1) }));
}

function renderContent(el, node) {
  el.replaceChildren();
  if (node.reasoning) {
    const det = h("details", { class: "reasoning", open: node.id === S.busy?.node.id && !node.content ? true : undefined },
      h("summary", { text: node.content || node.id !== S.busy?.node.id ? "Reasoning" : "Thinking…" }),
      h("div", { class: "reasoning-body", text: node.reasoning }));
    el.append(det);
  }
  const body = h("div", { class: "markdown" });
  if (node.role === "assistant" && node.id === S.busy?.node.id && !node.content && !node.reasoning) {
    const st = stateOf(S.models.get(node.model));
    const phase = S.models.get(node.model)?.status?.progress?.phase;
    el.append(h("div", { class: "waiting", role: "status" }, h("span", { class: "spinner", "aria-hidden": "true" }),
      h("span", { class: "muted small", text: st === "loading" ? `loading ${node.model}${phase ? ` · ${phase}` : ""}…`
                                           : st === "sleeping" ? `waking ${node.model}…` : "waiting for the first token…" })));
  }
  if (node.role === "user") body.append(h("div", { class: "plain", text: node.content }));
  else renderMarkdown(body, node.content);
  el.append(body);
  if (node.attachments?.length) {
    el.append(h("div", { class: "attachments" }, ...node.attachments.map((a) => a.kind === "image"
      ? h("img", { class: "thumb", src: a.data, alt: a.name }) : a.kind === "video" ? videoEl(a, "thumb")
      : h("span", { class: "chip", text: a.name }))));
  }
  if (node.error) el.append(h("div", { class: "error msg-error", text: node.error }));
  if (speech.answerAudio.has(node.id)) el.append(speech.player(speech.answerAudio.get(node.id)));
}

function messageEl(node) {
  const busy = S.busy?.node.id === node.id;
  const content = h("div", { class: "content" });
  renderContent(content, node);
  const actions = h("div", { class: "actions" },
    branchNav(node),
    node.role === "assistant" && node.model ? h("span", { class: "muted small model-tag", text: node.model }) : null,
    h("span", { class: "spacer" }),
    h("button", { class: "btn small copy", type: "button", text: "Copy", onclick: (ev) => copyText(node.content, ev.target) }),
    node.role === "assistant" && !busy ? speech.speakButton(S.models, S.selected, node,
      () => $(`.msg[data-id="${CSS.escape(node.id)}"] .content`), (e) => toast(`Speak: ${e.message || e}`)) : null,
    node.role === "user" ? h("button", { class: "btn small edit", type: "button", text: "Edit", disabled: !!S.busy,
                                         onclick: () => startEdit(node) }) : null,
    node.role === "assistant" ? h("button", { class: "btn small regen", type: "button", text: "Regenerate", disabled: !!S.busy,
                                              title: "Answer again (with the selected model)", onclick: () => regenerate(node) }) : null);
  return h("div", { class: `msg ${node.role}${busy ? " streaming" : ""}`, dataset: { id: node.id } },
    content, node.role === "assistant" ? fmtStats(node.stats) : null, actions);
}

function renderMessages() {
  const box = $("#messages");
  const path = S.conv ? pathTo(S.conv, S.conv.current) : [];
  $("#empty").hidden = path.length > 0;
  box.replaceChildren($("#empty"), ...path.map(messageEl));
  scrollDown(true);
  renderComposerState();
}

let renderPending = false;
function renderStreaming(node) {
  if (renderPending) return;
  renderPending = true;
  requestAnimationFrame(() => {
    renderPending = false;
    const el = $(`.msg[data-id="${CSS.escape(node.id)}"]`);
    if (!el) return;
    renderContent($(".content", el), node);
    scrollDown();
  });
}

function scrollDown(force = false) {
  const box = $("#messages");
  if (force || box.scrollHeight - box.scrollTop - box.clientHeight < 120) box.scrollTop = box.scrollHeight;
}

function startEdit(node) {
  const el = $(`.msg[data-id="${CSS.escape(node.id)}"] .content`);
  const ta = h("textarea", { class: "edit-box", rows: "3" });
  ta.value = node.content;
  const done = async (submit) => {
    if (!submit) { renderMessages(); return; }
    const text = ta.value.trim();
    if (!text) return;
    const conv = S.conv;
    const user = addNode(conv, node.parent, { role: "user", content: text, attachments: node.attachments });
    await generate(conv, user.id);
  };
  ta.addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing) { ev.preventDefault(); done(true); }
    if (ev.key === "Escape") done(false);
  });
  el.replaceChildren(ta, h("div", { class: "edit-buttons" },
    h("button", { class: "btn small", type: "button", text: "Cancel", onclick: () => done(false) }),
    h("button", { class: "btn small primary edit-submit", type: "button", text: "Send", onclick: () => done(true) })));
  ta.focus();
}

async function regenerate(node) {
  if (S.busy) return;
  await generate(S.conv, node.parent);
}

// ------------------------------------------------------------------ generation

function requestParams() {
  const s = S.settings;
  const out = {};
  for (const k of PARAMS) {
    if (s[k] !== undefined && s[k] !== "" && s[k] !== null) out[k] = Number(s[k]);
  }
  if (s.extra) Object.assign(out, JSON.parse(s.extra));
  return out;
}

function wireMessages(conv, leafId) {
  const msgs = [];
  if (S.settings.system) msgs.push({ role: "system", content: S.settings.system });
  for (const m of pathTo(conv, leafId)) {
    if (m.role !== "user" && m.role !== "assistant") continue;
    if (m.role === "assistant" && m.error && !m.content) continue;
    const texts = (m.attachments || []).filter((a) => a.kind === "text");
    const media = (m.attachments || []).filter((a) => a.kind === "image" || a.kind === "video");
    let text = m.content;
    for (const a of texts) text += `\n\n--- ${a.name} ---\n${a.data}`;
    msgs.push(media.length
      ? { role: m.role, content: [{ type: "text", text }, ...media.map(mediaPart)] }
      : { role: m.role, content: text });
  }
  return msgs;
}

// Streams an answer under `parentId` (a user message) into a new assistant node.
async function generate(conv, parentId) {
  const model = S.selected;
  if (!model) { toast("Select a model first"); openMenu(); return; }
  let extra;
  try { extra = requestParams(); } catch (e) { toast(`Extra request JSON is invalid: ${e.message}`); return; }
  const node = addNode(conv, parentId, { role: "assistant", model, reasoning: "" });
  const controller = new AbortController();
  S.busy = { controller, node };
  S.conv = conv;
  if (conv.name === "New chat") conv.name = (conv.messages[parentId].content || "Chat").slice(0, 60);
  await save(conv);
  renderMessages();
  const body = { model, messages: wireMessages(conv, parentId), stream: true,
                 stream_options: { include_usage: true }, ...extra };
  const spoken = speech.speaksAnswers(S.models, model) ? new speech.AnswerAudio() : null;
  if (spoken) Object.assign(body, speech.spokenFields());
  const t0 = performance.now();
  const stats = {};
  let timings = null;
  try {
    for await (const msg of api.stream("/v1/chat/completions", body, controller.signal)) {
      if (msg.data === "[DONE]") break;
      const chunk = JSON.parse(msg.data);
      if (chunk.error) throw new Error(chunk.error.message || "error");
      const delta = chunk.choices?.[0]?.delta;
      if (spoken && delta?.audio?.data) spoken.add(delta.audio.data);
      const piece = (delta?.content || "") + "";
      const thought = delta?.reasoning_content || "";
      if ((piece || thought) && stats.ttft_ms === undefined) stats.ttft_ms = performance.now() - t0;
      node.content += piece;
      node.reasoning += thought;
      if (chunk.timings) timings = chunk.timings;
      if (chunk.usage) {
        stats.prompt_tokens = chunk.usage.prompt_tokens;
        stats.completion_tokens = chunk.usage.completion_tokens;
      }
      if (piece || thought) renderStreaming(node);
    }
  } catch (e) {
    if (e.name === "AbortError") stats.stopped = true;
    else {
      node.error = String(e.message || e);  // shown in the message itself: no toast over the page too
      if (e instanceof api.AuthError) handleError(e);
    }
  }
  if (timings) {
    stats.prompt_tokens ??= timings.prompt_n;
    stats.completion_tokens ??= timings.predicted_n;
    stats.tokens_per_second = timings.predicted_per_second;
    if (timings.cache_n !== undefined) stats.cached_tokens = timings.cache_n;
  } else if (stats.completion_tokens && stats.ttft_ms !== undefined) {
    const gen_s = (performance.now() - t0 - stats.ttft_ms) / 1000;
    if (gen_s > 0) stats.tokens_per_second = (stats.completion_tokens - 1) / gen_s;
  }
  node.stats = stats;
  if (spoken?.size) speech.answerAudio.set(node.id, spoken.url());  // this page's only: not stored
  S.busy = null;
  await save(conv);
  renderMessages();
}

function stopGeneration() {
  S.busy?.controller.abort();
}

async function send() {
  const input = $("#input");
  const text = input.value.trim();
  if (S.busy || (!text && !S.attachments.length)) return;
  if (!S.selected) { toast("Select a model first"); openMenu(); return; }
  const conv = S.conv || db.newConversation();
  const user = addNode(conv, conv.current, { role: "user", content: text, attachments: S.attachments });
  S.attachments = [];
  renderAttachments();
  input.value = "";
  autoGrow();
  await generate(conv, user.id);
}

function renderComposerState() {
  $("#send").hidden = !!S.busy;
  $("#stop").hidden = !S.busy;
  for (const b of document.querySelectorAll(".msg .edit, .msg .regen")) b.disabled = !!S.busy;
}

function autoGrow() {
  const ta = $("#input");
  ta.style.height = "auto";
  ta.style.height = `${Math.min(ta.scrollHeight, 240)}px`;
}

// ------------------------------------------------------------------ attachments

// /props once the model is loaded; before that, the /v1/models card (the router reads its mmproj's header)
const hasVision = () => !!(S.modelProps.get(S.selected)?.modalities?.vision
  ?? S.models.get(S.selected)?.modalities?.vision);

function renderAttachHint() {
  $(".attach").title = hasVision() ? "Attach text files, images or videos"
    : "Attach text files (images and videos need a model with vision)";
}

const readDataURL = (f) => new Promise((res, rej) => {
  const r = new FileReader();
  r.onload = () => res(r.result);
  r.onerror = () => rej(r.error);
  r.readAsDataURL(f);
});

// A video goes as an OpenAI-style `video_url` part (a data URL); the server samples its frames.
const VIDEO_LIMIT = 20 * 1024 * 1024; // the server's bytes per image, audio or video
async function addVideo(f) {
  if (!hasVision()) { toast(`${f.name}: the selected model does not accept video`); return; }
  if (f.size > VIDEO_LIMIT) { toast(`${f.name}: larger than 20 MiB`); return; }
  S.attachments.push({ name: f.name, kind: "video", data: await readDataURL(f) });
}

const mediaPart = (a) => a.kind === "video"
  ? { type: "video_url", video_url: { url: a.data } } : { type: "image_url", image_url: { url: a.data } };

const videoEl = (a, cls) => h("video", { class: cls, src: a.data, title: a.name, controls: cls === "thumb",
                                        muted: true, preload: "metadata" });

async function addFiles(files) {
  for (const f of files) {
    if (f.type.startsWith("video/")) { await addVideo(f); continue; }
    if (f.type.startsWith("image/")) {
      if (!hasVision()) { toast(`${f.name}: the selected model does not accept images`); continue; }
      const data = await new Promise((res, rej) => {
        const r = new FileReader();
        r.onload = () => res(r.result);
        r.onerror = () => rej(r.error);
        r.readAsDataURL(f);
      });
      S.attachments.push({ name: f.name, kind: "image", data });
    } else {
      if (f.size > TEXT_LIMIT) { toast(`${f.name}: larger than 512 KiB`); continue; }
      const data = await f.text();
      if (data.includes("\u0000")) { toast(`${f.name}: not a text file`); continue; }
      S.attachments.push({ name: f.name, kind: "text", data });
    }
  }
  renderAttachments();
}

function renderAttachments() {
  $("#attachments").replaceChildren(...S.attachments.map((a, i) => h("span", { class: "chip" },
    a.kind === "image" ? h("img", { class: "thumb small", src: a.data, alt: "" })
      : a.kind === "video" ? videoEl(a, "thumb small") : null, a.name,
    h("button", { class: "btn icon small", type: "button", "aria-label": `Remove ${a.name}`, text: "×",
                 onclick: () => { S.attachments.splice(i, 1); renderAttachments(); } }))));
}

// ------------------------------------------------------------------ settings, API key, views

function renderSettingsPlaceholders() {
  const params = S.modelProps.get(S.selected)?.default_generation_settings?.params || {};
  const form = $("#settings-form");
  for (const k of PARAMS) {
    const v = k === "max_tokens" ? params.n_predict : params[k];
    form.elements[k].placeholder = v === undefined || v === -1 ? "server default" : String(v);
  }
}

function openSettings() {
  const form = $("#settings-form");
  for (const k of [...PARAMS, "system", "extra", "theme"]) form.elements[k].value = S.settings[k] ?? (k === "theme" ? "system" : "");
  form.elements.api_key.value = api.apiKey();
  $("#settings-error").hidden = true;
  renderSettingsPlaceholders();
  $("#settings-dialog").showModal();
}

function saveSettings(ev) {
  const form = $("#settings-form");
  if (ev.submitter?.value !== "save") return;
  const extra = form.elements.extra.value.trim();
  if (extra) {
    try {
      const parsed = JSON.parse(extra);
      if (typeof parsed !== "object" || Array.isArray(parsed) || parsed === null) throw new Error("must be a JSON object");
    } catch (e) {
      ev.preventDefault();
      $("#settings-error").textContent = `Extra request JSON: ${e.message}`;
      $("#settings-error").hidden = false;
      return;
    }
  }
  const s = {};
  for (const k of [...PARAMS, "system", "extra", "theme"]) {
    const v = form.elements[k].value;
    if (v !== "") s[k] = k === "system" || k === "extra" || k === "theme" ? v : Number(v);
  }
  S.settings = s;
  localStorage.setItem(SETTINGS_KEY, JSON.stringify(s));
  const key = form.elements.api_key.value.trim();
  if (key !== api.apiKey()) { api.setApiKey(key); S.canManage = true; start(); }
  applyTheme();
}

function askKey(e) {
  const d = $("#apikey-dialog");
  const err = $("#apikey-error");
  const had = api.apiKey();
  err.hidden = !had;  // a key was sent and refused: say so (first visit: just ask)
  err.textContent = had ? `That key was not accepted${e?.message ? `: ${e.message}` : ""}. Check it and try again.` : "";
  if (!d.open) d.showModal();
  if (had) $("#apikey-form").elements.key.select();
}

function setView(view) {
  S.view = view;
  $("#chat-view").hidden = view !== "chat";
  $("#models-view").hidden = view !== "models";
  $("#nav-chat").classList.toggle("active", view === "chat");
  $("#nav-models").classList.toggle("active", view === "models");
}

// ------------------------------------------------------------------ wiring

let watching = false;
async function start() {
  await refreshModels();
  fetchModelProps(S.selected);
  if (!watching) {
    watching = true;
    api.watchStatus(onStatus, () => { watching = false; askKey(); });
  }
}

function wire() {
  $("#composer").addEventListener("submit", (ev) => { ev.preventDefault(); send(); });
  $("#input").addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing) { ev.preventDefault(); send(); }
  });
  $("#input").addEventListener("input", autoGrow);
  document.addEventListener("keydown", (ev) => {
    if (ev.key === "Escape" && S.busy) { ev.preventDefault(); stopGeneration(); }
    if (ev.key === "Escape") closeMenu();
  });
  $("#stop").addEventListener("click", stopGeneration);
  $("#model-button").addEventListener("click", (ev) => {
    ev.stopPropagation();
    $("#model-menu").hidden ? openMenu() : closeMenu();
  });
  $("#model-menu").addEventListener("click", (ev) => ev.stopPropagation());
  document.addEventListener("click", closeMenu);
  $("#new-chat").addEventListener("click", newChat);
  $("#conv-search").addEventListener("input", (ev) => { S.search = ev.target.value; renderConversations(); });
  $("#export").addEventListener("click", exportAll);
  $("#import").addEventListener("change", (ev) => { if (ev.target.files[0]) importFile(ev.target.files[0]); ev.target.value = ""; });
  $("#file-input").addEventListener("change", (ev) => { addFiles([...ev.target.files]); ev.target.value = ""; });
  $("#composer").addEventListener("dragover", (ev) => ev.preventDefault());
  $("#composer").addEventListener("drop", (ev) => { ev.preventDefault(); addFiles([...ev.dataTransfer.files]); });
  $("#input").addEventListener("paste", (ev) => {
    const files = [...(ev.clipboardData?.files || [])];
    if (files.length) { ev.preventDefault(); addFiles(files); }
  });
  $("#open-settings").addEventListener("click", openSettings);
  $("#settings-form").addEventListener("submit", saveSettings);
  $("#pull-form").addEventListener("submit", pullRepo);
  $("#apikey-form").addEventListener("submit", () => {
    api.setApiKey($("#apikey-form").elements.key.value.trim());
    S.canManage = true;  // a new key: its rights are learned anew
    start();
    refreshConversations();
  });
  $("#nav-chat").addEventListener("click", () => setView("chat"));
  $("#nav-models").addEventListener("click", () => { setView("models"); refreshModels(); });
  $("#open-sidebar").addEventListener("click", () => document.body.classList.toggle("sidebar-open"));
  $("#close-sidebar").addEventListener("click", () => document.body.classList.remove("sidebar-open"));
}

async function main() {
  applyTheme();
  wire();
  if (innerWidth >= 800) document.body.classList.add("sidebar-open");
  await refreshConversations();
  if (S.convs.length) await openConversation(S.convs[0].id);
  await start();
  document.body.dataset.ready = "1";
}

// The vendored libraries are classic `defer` scripts; they run before module scripts.
main();
