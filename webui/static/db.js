// Conversations in IndexedDB: one record per conversation holding its message tree.
//   {id, name, created, updated, current, messages: {id: {id, parent, children, role, content, ...}}}
// The tree's root is a node with role "root"; `current` is the leaf shown.

const DB = "omni-webui";
const STORE = "conversations";
let dbp = null;

function open() {
  dbp ??= new Promise((resolve, reject) => {
    const req = indexedDB.open(DB, 1);
    req.onupgradeneeded = () => req.result.createObjectStore(STORE, { keyPath: "id" });
    req.onsuccess = () => resolve(req.result);
    req.onerror = () => reject(req.error);
  });
  return dbp;
}

async function tx(mode, fn) {
  const db = await open();
  return new Promise((resolve, reject) => {
    const t = db.transaction(STORE, mode);
    const req = fn(t.objectStore(STORE));
    t.oncomplete = () => resolve(req?.result);
    t.onerror = () => reject(t.error);
  });
}

export const listConversations = async () =>
  ((await tx("readonly", (s) => s.getAll())) || []).sort((a, b) => b.updated - a.updated);
export const getConversation = (id) => tx("readonly", (s) => s.get(id));
export const putConversation = (conv) => tx("readwrite", (s) => s.put(structuredClone(conv)));
export const deleteConversation = (id) => tx("readwrite", (s) => s.delete(id));

export function newId() {
  return Date.now().toString(36) + Math.random().toString(36).slice(2, 8);
}

export function newConversation() {
  const now = Date.now();
  return { id: newId(), name: "New chat", created: now, updated: now, current: "root",
           messages: { root: { id: "root", parent: null, children: [], role: "root", content: "" } } };
}

export function isConversation(c) {
  return c && typeof c.id === "string" && c.messages && c.messages.root && typeof c.current === "string";
}
