// Calls to this server's own routes (relative URLs, so a path prefix behind a proxy works),
// with the API key as a Bearer token, and a reader for the .npz archives /attention returns.

const KEY_STORAGE = "attnserve.apiKey";

export class AuthError extends Error {}

export class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

export function authRequired() {
  const meta = document.querySelector('meta[name="attnserve-auth-required"]');
  return meta !== null && meta.content === "true";
}

export function apiKey() {
  return sessionStorage.getItem(KEY_STORAGE);
}

export function setApiKey(key) {
  if (key) sessionStorage.setItem(KEY_STORAGE, key);
  else sessionStorage.removeItem(KEY_STORAGE);
}

function errorMessage(body, fallback) {
  if (body && typeof body.error === "string") return body.error;  // TGI shape
  if (body && body.error && body.error.message) return body.error.message;  // OpenAI shape
  if (body && Array.isArray(body.detail)) return body.detail.map((d) => d.msg).join("; ");
  return fallback;
}

async function call(path, { body = null, binary = false } = {}) {
  const headers = { Accept: binary ? "application/octet-stream" : "application/json" };
  if (body !== null) headers["Content-Type"] = "application/json";
  const key = apiKey();
  if (key) headers.Authorization = `Bearer ${key}`;
  const response = await fetch(path, {
    method: body === null ? "GET" : "POST", headers,
    body: body === null ? undefined : JSON.stringify(body),
  });
  if (response.status === 401) throw new AuthError("the API key was refused");
  if (!response.ok) {
    let parsed = null;
    try { parsed = await response.json(); } catch { /* not JSON */ }
    throw new ApiError(response.status, errorMessage(parsed, `${path}: HTTP ${response.status}`));
  }
  return binary ? readNpz(await response.arrayBuffer()) : response.json();
}

export const getInfo = () => call("info");

export function generate(inputs, maxNewTokens) {
  return call("generate", { body: { inputs, parameters: { max_new_tokens: maxNewTokens } } });
}

/** The LoRA adapters served: the names of GET /v1/models' cards that have a parent. */
export async function adapterNames() {
  const models = await call("v1/models");
  return models.data.filter((card) => card.parent).map((card) => card.id);
}

/** /attention as npz: {name: {shape, data}}; float arrays stay float32 (exact server values).
 *  ``adapter``: the name of a served LoRA adapter to compute under (null: the base);
 *  ``vector``: {name, scale} of a served control vector to steer by (null: none). */
export function attention(inputs, {
  layers = null, include = ["weights"], adapter = null, vector = null,
} = {}) {
  const body = { inputs, include, format: "npz" };
  if (layers !== null) body.layers = layers;
  if (adapter !== null) body.adapter_id = adapter;
  if (vector !== null) body.control_vector = { name: vector.name, scale: vector.scale };
  return call("attention", { body, binary: true });
}

/** /attention's logit lens and head attribution (JSON) at ``position`` (the query);
 *  ``vector``: {name, scale} of a served control vector to steer by (null: none). */
export function lookInside(inputs, position, { topK = 5, vector = null } = {}) {
  const body = { inputs, include: ["logit_lens", "head_attribution"], top_k: topK, position };
  if (vector !== null) body.control_vector = { name: vector.name, scale: vector.scale };
  return call("attention", { body });
}

// --- npz: a zip archive of .npy files (numpy.savez stores them uncompressed, zip64 headers) ---

const utf8 = new TextDecoder();

function zip64Field(view, start, length, wanted) {
  // The zip64 extra field (id 1) lists, in order, only the values whose 32-bit slot is full.
  const values = {};
  for (let p = start; p + 4 <= start + length;) {
    const id = view.getUint16(p, true);
    const size = view.getUint16(p + 2, true);
    if (id === 1) {
      let q = p + 4;
      for (const name of wanted) {
        values[name] = Number(view.getBigUint64(q, true));
        q += 8;
      }
    }
    p += 4 + size;
  }
  return values;
}

export function readNpz(buffer) {
  const view = new DataView(buffer);
  const bytes = new Uint8Array(buffer);
  let end = -1;
  for (let p = buffer.byteLength - 22; p >= Math.max(0, buffer.byteLength - 65557); p--) {
    if (view.getUint32(p, true) === 0x06054b50) { end = p; break; }
  }
  if (end < 0) throw new Error("not a zip archive");
  let count = view.getUint16(end + 10, true);
  let directory = view.getUint32(end + 16, true);
  if (directory === 0xffffffff || count === 0xffff) {
    const locator = end - 20;
    const record = Number(view.getBigUint64(locator + 8, true));
    count = Number(view.getBigUint64(record + 32, true));
    directory = Number(view.getBigUint64(record + 48, true));
  }
  const arrays = {};
  let p = directory;
  for (let n = 0; n < count; n++) {
    if (view.getUint32(p, true) !== 0x02014b50) throw new Error("bad zip directory");
    const method = view.getUint16(p + 10, true);
    let size = view.getUint32(p + 20, true);
    const usize = view.getUint32(p + 24, true);
    const nameLength = view.getUint16(p + 28, true);
    const extraLength = view.getUint16(p + 30, true);
    const commentLength = view.getUint16(p + 32, true);
    let local = view.getUint32(p + 42, true);
    const name = utf8.decode(bytes.subarray(p + 46, p + 46 + nameLength));
    const wanted = [];
    if (usize === 0xffffffff) wanted.push("usize");
    if (size === 0xffffffff) wanted.push("size");
    if (local === 0xffffffff) wanted.push("local");
    if (wanted.length) {
      const big = zip64Field(view, p + 46 + nameLength, extraLength, wanted);
      size = big.size ?? size;
      local = big.local ?? local;
    }
    if (method !== 0) throw new Error(`${name}: compressed npz entries are not supported`);
    const start = local + 30 + view.getUint16(local + 26, true) + view.getUint16(local + 28, true);
    arrays[name.replace(/\.npy$/, "")] = readNpy(buffer, start, size);
    p += 46 + nameLength + extraLength + commentLength;
  }
  return arrays;
}

function readNpy(buffer, start, size) {
  const bytes = new Uint8Array(buffer, start, size);
  if (bytes[0] !== 0x93 || utf8.decode(bytes.subarray(1, 6)) !== "NUMPY") {
    throw new Error("not a .npy entry");
  }
  const view = new DataView(buffer, start, size);
  const headerStart = bytes[6] === 1 ? 10 : 12;
  const headerLength = bytes[6] === 1 ? view.getUint16(8, true) : view.getUint32(8, true);
  const header = utf8.decode(bytes.subarray(headerStart, headerStart + headerLength));
  const descr = /'descr':\s*'([^']+)'/.exec(header)[1];
  if (/'fortran_order':\s*True/.test(header)) throw new Error("fortran-ordered array");
  const shape = /'shape':\s*\(([^)]*)\)/.exec(header)[1]
    .split(",").map((s) => s.trim()).filter((s) => s).map(Number);
  const n = shape.reduce((a, b) => a * b, 1);
  const offset = start + headerStart + headerLength;
  let data;
  const text = /^<U(\d+)$/.exec(descr);
  if (descr === "<f4") data = new Float32Array(buffer.slice(offset, offset + 4 * n));
  else if (descr === "<f8") data = new Float64Array(buffer.slice(offset, offset + 8 * n));
  else if (descr === "<i8") {
    data = Array.from(new BigInt64Array(buffer.slice(offset, offset + 8 * n)), Number);
  } else if (text) {
    const width = Number(text[1]);
    const codes = new Uint32Array(buffer.slice(offset, offset + 4 * width * n));
    data = [];
    for (let i = 0; i < n; i++) {
      let s = "";
      for (let c = i * width; c < (i + 1) * width && codes[c] !== 0; c++) {
        s += String.fromCodePoint(codes[c]);
      }
      data.push(s);
    }
  } else {
    throw new Error(`unsupported npy dtype ${descr}`);
  }
  return { shape, data };
}
