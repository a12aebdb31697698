// Speech in the chat page (issue 41), kept apart from app.js:
// - a "Speak" button on any answer: POST /v1/audio/speech to a voice the router serves (the selected
//   model's paired voice, else the first model that speaks), played under the answer;
// - spoken answers: with "Speak answers" on (a toggle in the top bar, shown for a chat model paired
//   with a voice), the chat asks for `modalities: ["text", "audio"]`; the answer's `delta.audio`
//   chunks (WAV: the header in the first, samples after) are joined into one WAV played under it.
import { apiKey } from "./api.js";

const TOGGLE_KEY = "omni.speakAnswers";
// node id -> a spoken answer's WAV (a blob URL: this page's only, not stored with the conversation)
export const answerAudio = new Map();
export const VOICE = "alloy";  // OpenAI's name: every voice here takes it (its first speaker)

// The voice for `selected`: its paired `speech_model`, else the first model that speaks.
export function voiceFor(models, selected) {
  const card = models.get(selected);
  if (card?.speech_model && models.has(card.speech_model)) return card.speech_model;
  for (const [id, c] of models) if (c.modalities?.speech) return id;
  return null;
}

const canSpeakAnswers = (models, selected) => !!models.get(selected)?.modalities?.audio_output;
const isOn = () => localStorage.getItem(TOGGLE_KEY) === "1";
export const speaksAnswers = (models, selected) => canSpeakAnswers(models, selected) && isOn();

// The top bar's "Speak answers" toggle: created once, shown only for a model paired with a voice.
let shown = { models: new Map(), selected: null };
export function renderToggle(models, selected) {
  shown = { models, selected };
  let b = document.querySelector("#speak-answers");
  if (!b) {
    b = document.createElement("button");
    b.id = "speak-answers";
    b.type = "button";
    b.className = "btn small";
    b.title = "Speak answers with the model's paired voice";
    b.addEventListener("click", () => {
      localStorage.setItem(TOGGLE_KEY, isOn() ? "0" : "1");
      renderToggle(shown.models, shown.selected);
    });
    document.querySelector("#topbar > .spacer")?.after(b);
  }
  b.hidden = !canSpeakAnswers(models, selected);
  b.setAttribute("aria-pressed", String(isOn()));
  b.textContent = isOn() ? "🔊 Speak answers: on" : "🔈 Speak answers: off";
}

// The request fields that ask for a spoken answer.
export const spokenFields = () => ({ modalities: ["text", "audio"], audio: { voice: VOICE, format: "wav" } });

// An answer's audio chunks as they stream in; `url()` is one WAV with its sizes filled in.
export class AnswerAudio {
  constructor() { this.parts = []; }
  add(b64) {
    const bin = atob(b64);
    const bytes = new Uint8Array(bin.length);
    for (let i = 0; i < bin.length; i++) bytes[i] = bin.charCodeAt(i);
    this.parts.push(bytes);
  }
  get size() { return this.parts.reduce((n, p) => n + p.length, 0); }
  url() {
    const all = new Uint8Array(this.size);
    let at = 0;
    for (const p of this.parts) { all.set(p, at); at += p.length; }
    if (all.length >= 44) {  // the streamed header says "until the end": write the real sizes
      const v = new DataView(all.buffer);
      v.setUint32(4, all.length - 8, true);
      v.setUint32(40, all.length - 44, true);
    }
    return URL.createObjectURL(new Blob([all], { type: "audio/wav" }));
  }
}

// `text` spoken by `model`: a URL of its WAV.
export async function speak(text, model) {
  const headers = { "content-type": "application/json" };
  if (apiKey()) headers.Authorization = `Bearer ${apiKey()}`;
  const resp = await fetch("/v1/audio/speech", { method: "POST", headers,
    body: JSON.stringify({ model, input: text.slice(0, 4096), voice: VOICE, response_format: "wav" }) });
  if (!resp.ok) {
    let msg = `${resp.status} ${resp.statusText}`;
    try { msg = (await resp.json()).error?.message || msg; } catch { /* not JSON */ }
    throw new Error(msg);
  }
  return URL.createObjectURL(await resp.blob());
}

// An audio player for `src`, playing at once when `autoplay`.
export function player(src, autoplay = false) {
  const a = document.createElement("audio");
  a.className = "speech-audio";
  a.controls = true;
  a.src = src;
  if (autoplay) a.play().catch(() => { /* the browser wants a click first: the controls are there */ });
  return a;
}

// The "Speak" button of an answer: speaks `node.content` and puts the player in `where()`.
export function speakButton(models, selected, node, where, onError) {
  const voice = voiceFor(models, selected);
  if (!voice || !node.content) return null;
  const b = document.createElement("button");
  b.type = "button";
  b.className = "btn small speak";
  b.textContent = "Speak";
  b.title = `Read this answer aloud (${voice})`;
  b.addEventListener("click", async () => {
    b.disabled = true;
    try {
      const el = where();
      el.querySelector(".speech-audio.spoken")?.remove();
      const p = player(await speak(node.content, voice), true);
      p.classList.add("spoken");
      el.append(p);
    } catch (e) { onError(e); } finally { b.disabled = false; }
  });
  return b;
}
