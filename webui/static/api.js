// Talking to the router: auth header, JSON calls, and a reader for Server-Sent Events over fetch
// (EventSource cannot send an Authorization header, and the router may need one).

const KEY = "omni.apiKey";

export class AuthError extends Error {}
export class ForbiddenError extends Error {}  // 403: a valid key without the right (a user key's admin action)

export function apiKey() { return localStorage.getItem(KEY) || ""; }
export function setApiKey(key) { key ? localStorage.setItem(KEY, key) : localStorage.removeItem(KEY); }

function headers(extra = {}) {
  const h = { ...extra };
  const key = apiKey();
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

async function errorOf(resp) {
  let msg = `${resp.status} ${resp.statusText}`;
  try { msg = (await resp.json()).error?.message || msg; } catch { /* not JSON */ }
  return msg;
}

export async function call(method, path, body, signal) {
  const init = { method, headers: headers(body ? { "content-type": "application/json" } : {}), signal };
  if (body) init.body = JSON.stringify(body);
  const resp = await fetch(path, init);
  if (resp.status === 401) throw new AuthError(await errorOf(resp));
  if (resp.status === 403) throw new ForbiddenError(await errorOf(resp));
  if (!resp.ok) throw new Error(await errorOf(resp));
  return resp.json();
}

export const getModels = () => call("GET", "/v1/models").then((r) => r.data);
export const getProps = (model) => call("GET", model ? `/props?model=${encodeURIComponent(model)}&autoload=false` : "/props");
export const loadModel = (model) => call("POST", "/models/load", { model });
export const unloadModel = (model) => call("POST", "/models/unload", { model });
export const sleepModel = (model) => call("POST", "/models/sleep", { model });

// POST /models/pull: yields each NDJSON line (progress, then success); an error before any byte
// moved is thrown with the router's message (a 404 lists the repo's tags).
export async function* pullModel(model, signal) {
  const resp = await fetch("/models/pull", { method: "POST", signal,
    headers: headers({ "content-type": "application/json" }), body: JSON.stringify({ model }) });
  if (resp.status === 401) throw new AuthError(await errorOf(resp));
  if (!resp.ok) throw new Error(await errorOf(resp));
  const reader = resp.body.getReader();
  const dec = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buf += dec.decode(value, { stream: true });
    let nl;
    while ((nl = buf.indexOf("\n")) >= 0) {
      const line = buf.slice(0, nl).trim();
      buf = buf.slice(nl + 1);
      if (line) yield JSON.parse(line);
    }
  }
}

// Yields {event, data} for each SSE message of a streaming response.
async function* sseMessages(resp) {
  const reader = resp.body.pipeThrough(new TextDecoderStream()).getReader();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buf += value;
    let cut;
    while ((cut = buf.search(/\r?\n\r?\n/)) >= 0) {
      const block = buf.slice(0, cut);
      buf = buf.slice(cut).replace(/^\r?\n\r?\n/, "");
      let event = "message";
      const data = [];
      for (const line of block.split(/\r?\n/)) {
        if (line.startsWith("event:")) event = line.slice(6).trim();
        else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
      }
      if (data.length) yield { event, data: data.join("\n") };
    }
  }
}

export async function* stream(path, body, signal) {
  const resp = await fetch(path, {
    method: body ? "POST" : "GET", signal,
    headers: headers(body ? { "content-type": "application/json", accept: "text/event-stream" } : { accept: "text/event-stream" }),
    body: body ? JSON.stringify(body) : undefined,
  });
  if (resp.status === 401) throw new AuthError(await errorOf(resp));
  if (!resp.ok) throw new Error(await errorOf(resp));
  yield* sseMessages(resp);
}

// Follows /models/sse forever (reconnecting), calling onStatus(model, status) per event.
export async function watchStatus(onStatus, onAuth) {
  for (let delay = 500; ; delay = Math.min(delay * 2, 10000)) {
    try {
      for await (const msg of stream("/models/sse")) {
        delay = 500;
        const data = JSON.parse(msg.data);
        if (data.model && data.status) onStatus(data.model, data.status);
      }
    } catch (e) {
      if (e instanceof AuthError) { onAuth(); return; }
    }
    await new Promise((r) => setTimeout(r, delay));
  }
}
