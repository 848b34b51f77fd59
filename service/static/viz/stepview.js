// Step-by-step view of one layer, head and query token, in the order attention computes it:
// q, the keys, raw scores q·kⱼ, scaled ÷√d_k, the causal mask, α = softmax, the values and
// the output Σ αⱼ vⱼ. Scores, scaled scores, α, q, k and v are the server's own numbers
// (attention.onnx); the output and the checks are computed here from them. Every number
// shown is also in a data attribute at full precision.

import { divergingRgb, fmt, isDark, sizeCanvas, tokenLabel } from "./colors.js";

const MASKED_ROWS_SHOWN = 8;  // more masked keys than this collapse into one summary row

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") node.className = v;
    else if (k === "text") node.textContent = v;
    else if (k.startsWith("data-")) node.setAttribute(k, v);
    else node[k] = v;
  }
  for (const c of children) if (c !== null) node.append(c);
  return node;
}

/** Row `i` of a (1, H, T, n) array for head h, as plain numbers. */
function row(array, h, i) {
  const [, , T, n] = array.shape;
  const start = (h * T + i) * n;
  return Array.from(array.data.subarray(start, start + n));
}

function vectorStrip(id, values, scale) {
  const strip = el("div", { class: "vector", id, "data-values": JSON.stringify(values) });
  const dark = isDark();
  values.forEach((x, c) => {
    const cell = el("span", { class: "vcell", title: `[${c}] = ${x}` }, el("small", { text: c }), fmt(x, 3));
    const [r, g, b] = divergingRgb(scale > 0 ? x / scale : 0, dark);
    cell.style.backgroundColor = `rgb(${r}, ${g}, ${b})`;
    strip.append(cell);
  });
  return strip;
}

function maxAbs(values) {
  return values.reduce((m, x) => (Number.isFinite(x) ? Math.max(m, Math.abs(x)) : m), 0);
}

function section(n, title, formula, ...body) {
  return el("section", { class: "stage" },
    el("h3", {}, el("span", { class: "num", text: n }), title,
      formula ? el("code", { class: "formula", text: formula }) : null),
    ...body);
}

export class StepView {
  constructor(root) {
    this.root = root;
  }

  /** data: npz of one layer {q, k, v, scores, scaled_scores, weights}, each (1, H, T, ·). */
  render(data, tokens, layer, head, query) {
    const { q, k, v, scores, scaled_scores: scaled, weights } = data;
    const [, , T, d] = q.shape;
    const i = query;
    const qi = row(q, head, i);
    const K = Array.from({ length: T }, (_, j) => row(k, head, j));
    const V = Array.from({ length: T }, (_, j) => row(v, head, j));
    const s = row(scores, head, i);
    const sc = row(scaled, head, i);
    const alpha = row(weights, head, i);
    const root = Math.sqrt(d);
    const out = new Array(d).fill(0);
    for (let j = 0; j < T; j++) for (let c = 0; c < d; c++) out[c] += alpha[j] * V[j][c];
    if (this.key === undefined || this.key > i || this.keyFor !== `${layer}|${head}|${i}`) {
      this.key = alpha.indexOf(Math.max(...alpha.slice(0, i + 1)));
      this.keyFor = `${layer}|${head}|${i}`;
    }

    this.root.replaceChildren();
    this.root.dataset.layer = layer;
    this.root.dataset.head = head;
    this.root.dataset.query = i;
    this.root.append(el("p", { class: "step-title" },
      el("strong", { text: `layer ${layer} · head ${head} · query ${i} ` }),
      el("span", { class: "tok", text: `“${tokenLabel(tokens[i].text, 24)}”` }),
      el("span", { class: "muted", text: ` · ${T} tokens · d_k = ${d}`, id: "step-dk", "data-value": d })));

    const qScale = Math.max(maxAbs(qi), 1e-12);
    this.root.append(section("1", "Query vector of the token", `q = x·W_Q  (${d} numbers)`,
      vectorStrip("step-q", qi, qScale)));

    const kScale = Math.max(maxAbs(K.flat()), 1e-12);
    const kStrip = el("div", { class: "picked" });
    this.root.append(section("2", "Key vectors of every token", `K: ${T} × ${d}; row j = kⱼ`,
      this.matrix(K, kScale, i, "step-k"), kStrip));

    const table = this.scoreTable(tokens, s, sc, alpha, i, root);
    this.root.append(section("3–6", "Scores, scaling, mask and softmax for each key",
      `sⱼ = q·kⱼ   ŝⱼ = sⱼ / √${d} (= ${fmt(root, 4)})   ŝⱼ = −∞ for j > ${i}   αⱼ = exp(ŝⱼ) / Σ exp(ŝ)`,
      table));

    const vScale = Math.max(maxAbs(V.flat()), 1e-12);
    const vStrip = el("div", { class: "picked" });
    this.root.append(section("7", "Value vectors, weighted by α", `V: ${T} × ${d}; row j = vⱼ`,
      this.matrix(V, vScale, i, "step-v", alpha), vStrip));

    this.root.append(section("8", "Output of the head for this token", "o = Σⱼ αⱼ vⱼ",
      vectorStrip("step-out", out, Math.max(maxAbs(out), 1e-12))));

    // Checks: recompute in double precision from the server's q, k and scaled scores.
    let scoreDiff = 0;
    let alphaDiff = 0;
    const finite = sc.slice(0, i + 1);
    const top = Math.max(...finite);
    const exps = finite.map((x) => Math.exp(x - top));
    const total = exps.reduce((a, b) => a + b, 0);
    for (let j = 0; j < T; j++) {
      const dot = qi.reduce((acc, x, c) => acc + x * K[j][c], 0);
      scoreDiff = Math.max(scoreDiff, Math.abs(dot - s[j]));
      alphaDiff = Math.max(alphaDiff, Math.abs((j <= i ? exps[j] / total : 0) - alpha[j]));
    }
    const sum = alpha.reduce((a, b) => a + b, 0);
    this.root.append(el("p", { class: "checks muted", id: "step-checks",
      "data-sum": sum, "data-score-diff": scoreDiff, "data-alpha-diff": alphaDiff },
    `Checks in this browser: Σα = ${sum.toFixed(7)} · max |q·kⱼ − sⱼ| = ${scoreDiff.toExponential(1)}`
      + ` · max |softmax(ŝ) − α| = ${alphaDiff.toExponential(1)}`));

    const pick = (j) => {
      this.key = j;
      kStrip.replaceChildren(el("span", { class: "muted", text: `k${j} “${tokenLabel(tokens[j].text)}”` }),
        vectorStrip("step-kj", K[j], kScale),
        el("span", { class: "muted", text: `q·k${j} = Σ qc·k${j}c = ${fmt(s[j], 4)}` }));
      vStrip.replaceChildren(el("span", { class: "muted", text: `v${j} “${tokenLabel(tokens[j].text)}”, α${j} = ${fmt(alpha[j], 4)}` }),
        vectorStrip("step-vj", V[j], vScale));
      for (const tr of table.querySelectorAll("tr.key")) tr.classList.toggle("picked-row", Number(tr.dataset.j) === j);
    };
    table.addEventListener("click", (e) => {
      const tr = e.target.closest("tr.key");
      if (tr) pick(Number(tr.dataset.j));
    });
    for (const canvas of this.root.querySelectorAll("canvas.matrix")) {
      canvas.addEventListener("click", (e) => {
        const j = Math.floor((e.clientY - canvas.getBoundingClientRect().top) / canvas.rowHeight);
        if (j >= 0 && j < T) pick(j);
      });
    }
    pick(this.key);
  }

  scoreTable(tokens, s, sc, alpha, i, root) {
    const T = s.length;
    const tbody = el("tbody");
    const masked = T - i - 1;
    const maxAlpha = Math.max(...alpha);
    const addRow = (j) => {
      const hidden = j > i;
      const bar = el("span", { class: "bar" });
      bar.style.setProperty("--w", maxAlpha > 0 ? alpha[j] / maxAlpha : 0);
      tbody.append(el("tr", {
        class: `key${hidden ? " masked" : ""}`, "data-j": j, "data-score": s[j],
        "data-scaled": sc[j], "data-alpha": alpha[j], "data-masked": hidden,
      }, el("td", { class: "n", text: j }), el("td", { class: "tok", text: tokenLabel(tokens[j].text, 16) }),
      el("td", { class: "n", text: fmt(s[j]) }), el("td", { class: "n", text: fmt(s[j] / root) }),
      el("td", { class: "c", text: hidden ? "−∞" : "0" }), el("td", { class: "n", text: fmt(sc[j]) }),
      el("td", { class: "alpha" }, bar, el("span", { text: fmt(alpha[j]) }))));
    };
    for (let j = 0; j <= i; j++) addRow(j);
    if (masked > 0 && masked <= MASKED_ROWS_SHOWN) {
      for (let j = i + 1; j < T; j++) addRow(j);
    } else if (masked > 0) {
      tbody.append(el("tr", { class: "masked summary", "data-masked-from": i + 1, "data-masked-count": masked },
        el("td", { class: "n", text: `${i + 1}…${T - 1}` }),
        el("td", { class: "tok", text: `${masked} later tokens` }),
        el("td", { class: "n", text: "…" }), el("td", { class: "n", text: "…" }),
        el("td", { class: "c", text: "−∞" }), el("td", { class: "n", text: "−∞" }),
        el("td", { class: "alpha" }, el("span", { text: fmt(0) }))));
    }
    const head = el("thead", {}, el("tr", {},
      el("th", { text: "j" }), el("th", { text: "key token" }), el("th", { text: "③ sⱼ = q·kⱼ" }),
      el("th", { text: "④ sⱼ/√d_k" }), el("th", { text: "⑤ mask" }), el("th", { text: "ŝⱼ (masked)" }),
      el("th", { text: "⑥ αⱼ" })));
    return el("div", { class: "scroll table-scroll" }, el("table", { class: "scores", id: "step-table" }, head, tbody));
  }

  /** A T × d heatmap of vectors (rows = tokens); masked rows dimmed, α drawn as a side bar. */
  matrix(rows, scale, query, id, alpha = null) {
    const T = rows.length;
    const d = rows[0].length;
    const rh = Math.max(2, Math.min(12, Math.floor(300 / T)));
    const cw = Math.max(4, Math.min(18, Math.floor(360 / d)));
    const bar = alpha ? 60 : 0;
    const canvas = el("canvas", { class: "matrix", id });
    canvas.rowHeight = rh;
    const ctx = sizeCanvas(canvas, bar + d * cw, T * rh);
    const dark = isDark();
    const top = alpha ? Math.max(...alpha) || 1 : 1;  // bars relative to the largest α
    for (let j = 0; j < T; j++) {
      for (let c = 0; c < d; c++) {
        const [r, g, b] = divergingRgb(rows[j][c] / scale, dark);
        ctx.fillStyle = `rgb(${r}, ${g}, ${b})`;
        ctx.fillRect(bar + c * cw, j * rh, cw, rh);
      }
      if (alpha) {
        ctx.fillStyle = "rgba(214, 120, 40, 0.9)";
        const w = (alpha[j] / top) * (bar - 8);
        ctx.fillRect(bar - 4 - w, j * rh, w, Math.max(1, rh - 1));
      }
    }
    if (query + 1 < T) {  // keys after the query are masked: dim them
      ctx.fillStyle = dark ? "rgba(0, 0, 0, 0.55)" : "rgba(255, 255, 255, 0.65)";
      ctx.fillRect(bar, (query + 1) * rh, d * cw, (T - query - 1) * rh);
    }
    ctx.strokeStyle = dark ? "#e8e8e8" : "#222";
    ctx.lineWidth = 1;
    ctx.strokeRect(bar + 0.5, query * rh + 0.5, d * cw - 1, rh - 1);
    return el("div", { class: "scroll matrix-scroll" }, canvas);
  }
}
