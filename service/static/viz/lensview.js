// Logit lens and head attribution of one input, from /attention's logit_lens and
// head_attribution members (JSON). The lens: layers × positions, each cell the top token of
// that layer's residual read through the final norm and the LM head, its background the
// token's probability in viridis, the cell's top-k on hover. Attribution: layers × heads,
// each head's direct contribution to the target's logit at the chosen position (the query)
// on a diverging blue–neutral–red scale stretched to the largest |contribution|. Values at
// full precision in data attributes. Under a control vector (the response's control_vector,
// echoed by /attention) both captions name it.

import { divergingRgb, fmt, isDark, tokenLabel, viridisCss } from "./colors.js";

function cell(tag, text, attrs = {}) {
  const el = document.createElement(tag);
  el.textContent = text;
  for (const [k, v] of Object.entries(attrs)) el.dataset[k] = v;
  return el;
}

export class LensView {
  /** root: the element the two tables go in; onQuery(p): a lens cell was clicked. */
  constructor(root, onQuery) {
    this.root = root;
    this.onQuery = onQuery;
  }

  /** data: /attention's JSON with logit_lens and head_attribution; query: its position. */
  show(data, tokens, query) {
    const lens = data.logit_lens;
    const attr = data.head_attribution;
    const layers = data.layers;
    const table = document.createElement("table");
    table.id = "lens-table";
    table.className = "lens-table";
    const head = document.createElement("tr");
    head.append(cell("th", "layer"), ...tokens.map((t, p) => cell("th", tokenLabel(t.text, 8),
      { pos: p })));
    table.append(head);
    for (let row = layers.length - 1; row >= 0; row--) {  // the last layer on top
      const tr = document.createElement("tr");
      tr.append(cell("th", `${layers[row]}`));
      lens.top_ids[row].forEach((ids, p) => {
        const probs = lens.top_probs[row][p];
        const td = cell("td", tokenLabel(lens.top_tokens[row][p][0], 8), {
          layer: layers[row], pos: p, token: ids[0], prob: probs[0] });
        td.style.background = viridisCss(probs[0]);
        td.style.color = probs[0] > 0.6 ? "#111" : "#eee";
        td.title = ids.map((id, k) => `${tokenLabel(lens.top_tokens[row][p][k], 16)}  ${fmt(probs[k], 3)}`)
          .join("\n");
        if (p === query) td.classList.add("query");
        td.addEventListener("click", () => this.onQuery(p));
        tr.append(td);
      });
      table.append(tr);
    }
    const vector = data.control_vector;
    const under = vector ? `, under control vector ${vector.name} × ${vector.scale}` : "";
    const caption = cell("p", `Head attribution at ${query}: ${tokenLabel(tokens[query].text, 16)} → `
      + `${tokenLabel(attr.target_token, 16)} (logit ${fmt(attr.logit, 3)})${under}`,
    { target: attr.target });
    caption.className = "hint";
    const grid = document.createElement("table");
    grid.id = "attr-table";
    grid.className = "attr-table";
    const heads = attr.heads[0].length;
    const top = document.createElement("tr");
    top.append(cell("th", "layer"), ...Array.from({ length: heads }, (_, h) => cell("th", `${h}`)),
      cell("th", "mlp"));
    grid.append(top);
    const scale = Math.max(1e-12, ...attr.heads.flat().map(Math.abs), ...attr.mlp.map(Math.abs));
    const dark = isDark();
    for (let l = attr.heads.length - 1; l >= 0; l--) {
      const tr = document.createElement("tr");
      tr.append(cell("th", `${l}`));
      const values = [...attr.heads[l], attr.mlp[l]];
      values.forEach((v, h) => {
        const td = cell("td", fmt(v, 2), { layer: l, head: h < heads ? h : "mlp", value: v });
        td.style.background = `rgb(${divergingRgb(v / scale, dark).join(",")})`;
        td.title = `${h < heads ? `layer ${l} head ${h}` : `layer ${l} MLP`}: ${fmt(v, 5)}`;
        tr.append(td);
      });
      grid.append(tr);
    }
    this.root.replaceChildren(cell("p", `Logit lens: each layer's top next token${under}`, {}),
      table, caption, grid);
    this.root.dataset.query = query;
    this.root.dataset.vector = vector ? `${vector.name} ${vector.scale}` : "";
  }
}
