// Markdown -> sanitized DOM. Model output is untrusted: raw HTML in the Markdown is shown as
// text (never parsed as HTML), and what marked produces goes through DOMPurify anyway.
/* global marked, DOMPurify, hljs */

const escape = (s) => s.replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
let ready = false;

function setup() {
  if (ready) return;
  ready = true;
  marked.use({
    gfm: true,
    breaks: false,
    renderer: {
      html(token) { return escape(token.text ?? token.raw ?? ""); },
    },
  });
  DOMPurify.addHook("afterSanitizeAttributes", (node) => {
    if (node.tagName === "A") {
      node.setAttribute("target", "_blank");
      node.setAttribute("rel", "noopener noreferrer");
    }
  });
}

const PURIFY = { USE_PROFILE: { html: true }, FORBID_TAGS: ["style", "form", "input", "button", "textarea", "select"],
                 FORBID_ATTR: ["style"], ALLOWED_URI_REGEXP: /^(?:https?:|mailto:|#|\/)/i };

export function renderMarkdown(el, text) {
  setup();
  const html = DOMPurify.sanitize(marked.parse(text || ""), PURIFY);
  el.innerHTML = html;
  for (const code of el.querySelectorAll("pre > code")) {
    const lang = [...code.classList].find((c) => c.startsWith("language-"))?.slice(9);
    if (lang && hljs.getLanguage(lang)) {
      code.innerHTML = hljs.highlight(code.textContent, { language: lang, ignoreIllegals: true }).value;
    } else if (code.textContent.length < 20000) {
      code.innerHTML = hljs.highlightAuto(code.textContent).value;
    }
    code.classList.add("hljs");
    const pre = code.parentElement;
    const bar = document.createElement("div");
    bar.className = "code-bar";
    const label = document.createElement("span");
    label.textContent = lang || "code";
    const copy = document.createElement("button");
    copy.className = "btn small copy-code";
    copy.type = "button";
    copy.textContent = "Copy";
    copy.addEventListener("click", () => copyText(code.textContent, copy));
    bar.append(label, copy);
    pre.prepend(bar);
  }
  for (const table of el.querySelectorAll("table")) {
    const wrap = document.createElement("div");
    wrap.className = "table-wrap";
    table.replaceWith(wrap);
    wrap.append(table);
  }
}

export async function copyText(text, button) {
  try {
    await navigator.clipboard.writeText(text);
  } catch {
    const ta = document.createElement("textarea");
    ta.value = text;
    document.body.append(ta);
    ta.select();
    document.execCommand("copy");
    ta.remove();
  }
  if (button) {
    const old = button.textContent;
    button.textContent = "Copied";
    setTimeout(() => { button.textContent = old; }, 1200);
  }
}
