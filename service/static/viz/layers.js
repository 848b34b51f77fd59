// Attention weights of one input, layer by layer: fetched from /attention on demand and
// kept within a memory budget. The server computes only the layers asked for, so opening
// the page costs one layer, not the model (30 layers × 9 heads × 300² floats is 97 MB).

/** Bytes of maps asked for in one request, and at most kept here (at least two layers). */
export const DEFAULT_BUDGET = 48 * 2 ** 20;

export class LayerStore {
  /**
   * fetchLayers: (layers) → Promise of an npz {weights: {shape [n, H, T, T], data}, layers}.
   * first: the npz that opened the page (its layers are kept).
   */
  constructor(fetchLayers, { L, H, T }, budget = DEFAULT_BUDGET) {
    this.fetchLayers = fetchLayers;
    this.L = L;
    this.H = H;
    this.T = T;
    this.size = H * T * T;  // floats per layer
    this.perRequest = Math.max(1, Math.min(L, Math.floor(budget / (4 * this.size))));
    this.keep = Math.max(2, this.perRequest);
    this.maps = new Map();     // layer → Float32Array (H, T, T); the most recently used last
    this.pending = new Map();  // layer → Promise of its request
    this.requests = [];        // the layer lists asked for, in order (for tests and the console)
  }

  has(layer) { return this.maps.has(layer); }

  /** The layer's maps if held (marking them recently used), else undefined. */
  get(layer) {
    const maps = this.maps.get(layer);
    if (maps !== undefined) {
      this.maps.delete(layer);
      this.maps.set(layer, maps);
    }
    return maps;
  }

  /** Keep every layer of an /attention npz; returns [[layer, maps], …]. */
  add(npz) {
    const layers = npz.layers.data;
    const out = layers.map((layer, i) => {
      // A copy per layer, so evicting one frees it (a view would pin the whole response).
      const maps = npz.weights.data.slice(i * this.size, (i + 1) * this.size);
      this.maps.delete(layer);
      this.maps.set(layer, maps);
      return [layer, maps];
    });
    while (this.maps.size > this.keep) this.maps.delete(this.maps.keys().next().value);
    return out;
  }

  /** One request for ``layers``; every layer in it resolves with the response. */
  request(layers) {
    this.requests.push(layers);
    const promise = this.fetchLayers(layers).then((npz) => this.add(npz)).finally(() => {
      for (const l of layers) if (this.pending.get(l) === promise) this.pending.delete(l);
    });
    for (const l of layers) this.pending.set(l, promise);
    return promise;
  }

  /** The layer's maps, fetched if not held. */
  async need(layer) {
    const held = this.get(layer);
    if (held !== undefined) return held;
    const got = await (this.pending.get(layer) || this.request([layer]));
    const pair = got.find(([l]) => l === layer);
    return pair[1];
  }

  /** Every layer once, in requests of at most perRequest layers: ``onLayer(layer, maps)``
   *  as each arrives (held ones first). ``alive()`` false stops it (a new input). */
  async each(onLayer, alive = () => true) {
    const missing = [];
    for (let l = 0; l < this.L; l++) {
      const held = this.maps.get(l);
      if (held !== undefined) onLayer(l, held);
      else missing.push(l);
    }
    while (missing.length && alive()) {
      const group = [];
      const waits = [];
      while (missing.length && group.length < this.perRequest) {
        const l = missing.shift();
        if (this.pending.has(l)) waits.push(this.pending.get(l));
        else group.push(l);
      }
      const results = await Promise.all([...waits, ...(group.length ? [this.request(group)] : [])]);
      if (!alive()) return;
      for (const pairs of results) for (const [l, maps] of pairs) onLayer(l, maps);
    }
  }
}
