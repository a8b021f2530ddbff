// The dikkat attention report (dikkat.viz.report; docs/report.md): a head view, a labelled heat
// map and a model view, drawn from the JSON in <script id="dikkat-data">. Plain browser
// JavaScript, no libraries, no network. Every piece of text goes in through textContent (never
// innerHTML), so a token such as "<script>" or "&amp;" is shown as it is written.
"use strict";
(function () {
  const data = JSON.parse(document.getElementById("dikkat-data").textContent);
  const Tq = data.queries.length;
  const Tk = data.keys.length;
  const H = data.heads.length;
  const MIN_WEIGHT = 0.01; // fainter lines are not drawn: invisible, and they would swamp the page
  const ROW = 22; // px per token in the head view
  const LABEL = 250; // px for each column of tokens (MAX_CHARS of 13 px monospace fit)
  const GAP = 280; // px between the two columns, where the lines run
  const MAX_CHARS = 30; // longer labels are cut; the tooltip has the whole label
  const CELL = 72; // px of the longer side of each heat map in the model view
  const HEAT = { most: 18, least: 3, span: 720, label: 200, font: 11 }; // the labelled heat map

  // what is shown: the layer, which heads, the token picked (menu or click) and the one under the
  // pointer ({side: "q" | "k", index} or null), and how a head box behaves ("one": alone)
  const open = data.open;
  const state = {
    layer: open.layer,
    heads: data.heads.map((_, h) => open.heads.includes(h)),
    token: open.focus === null ? null : { side: "q", index: open.focus },
    hover: null,
    mode: "all",
  };

  // how much query row i attends to key j, in head h of layer l (weights are stored × scale)
  const weight = (l, h, i, j) => data.weights[l][h][i * Tk + j] / data.scale;

  // one colour per head, spread around the hue circle by the golden angle
  const colours = data.heads.map((_, h) => `hsl(${(h * 137.508) % 360}, 70%, 42%)`);

  const svg = document.getElementById("head-view");
  const SVG_NS = svg.namespaceURI; // the SVG namespace, read off the page's own <svg>

  function make(tag, attrs = {}, text = null, ns = null) {
    const node = ns ? document.createElementNS(ns, tag) : document.createElement(tag);
    for (const [name, value] of Object.entries(attrs)) node.setAttribute(name, String(value));
    if (text !== null) node.textContent = text;
    return node;
  }
  const makeSvg = (tag, attrs, text = null) => make(tag, attrs, text, SVG_NS);
  const shorten = (s, n = MAX_CHARS) => (s.length > n ? s.slice(0, n - 1) + "…" : s);
  const same = (a, b) => a !== null && b !== null && a.side === b.side && a.index === b.index;

  // ---- the header: title, and what the two columns are
  const SIDES = {
    self: "left: the query tokens, right: the tokens they attend to",
    cross: "left: the target (queries), right: the source (keys)",
    image: "left: the query tokens, right: the image patches (keys)",
  };
  document.getElementById("title").textContent = data.title || "attention";
  document.getElementById("kind").textContent =
    `${data.kind} attention, ${data.layers.length} layers × ${H} heads; ${SIDES[data.kind]}.`;

  // ---- controls: the layer menu, the token menu, all / one / none, a check box per head
  const select = document.getElementById("layer");
  data.layers.forEach((name, l) => select.append(make("option", { value: l }, name)));
  select.value = String(state.layer);
  select.addEventListener("change", () => {
    state.layer = Number(select.value);
    update();
  });

  const tokenMenu = document.getElementById("token");
  tokenMenu.append(make("option", { value: "" }, "every token"));
  for (const [side, labels, what] of [["q", data.queries, "queries"], ["k", data.keys, "keys"]]) {
    const group = make("optgroup", { label: what });
    labels.forEach((t, i) => {
      const where = side === "q" ? `position ${data.rows[i]}` : `key ${i}`;
      group.append(make("option", { value: `${side}:${i}` }, `${shorten(t, 24)} (${where})`));
    });
    tokenMenu.append(group);
  }
  tokenMenu.addEventListener("change", () => {
    const [side, index] = tokenMenu.value.split(":");
    state.token = tokenMenu.value === "" ? null : { side, index: Number(index) };
    update();
  });

  const modes = [...document.querySelectorAll("input[name='head-mode']")];
  modes.forEach((radio) => radio.addEventListener("change", () => setMode(radio.value)));

  const boxes = data.heads.map((head, h) => {
    const box = make("input", { type: "checkbox", "data-head": h });
    box.addEventListener("change", () => {
      if (state.mode === "one") state.heads = data.heads.map((_, k) => k === h);
      else state.heads[h] = box.checked;
      if (state.mode !== "one") state.mode = modeOf(state.heads);
      update();
    });
    const chip = make("label", { class: "chip", style: `--c: ${colours[h]}` });
    chip.append(box, data.head_labels[h]);
    document.getElementById("heads").append(chip);
    return box;
  });

  // "all" and "none" as the boxes say; exactly one shown opens in "one", where a box picks its
  // head alone; any other choice is "some" (no radio button checked)
  function modeOf(heads) {
    const n = heads.filter(Boolean).length;
    return n === H ? "all" : n === 0 ? "none" : n === 1 ? "one" : "some";
  }
  state.mode = modeOf(state.heads);

  function setMode(mode) {
    if (mode === "all") state.heads = data.heads.map(() => true);
    if (mode === "none") state.heads = data.heads.map(() => false);
    if (mode === "one") {
      const first = Math.max(0, state.heads.indexOf(true));
      state.heads = data.heads.map((_, h) => h === first);
    }
    state.mode = mode;
    update();
  }

  // ---- head view: queries on the left, keys on the right, the lines below the tokens
  svg.setAttribute("width", 2 * LABEL + GAP);
  svg.setAttribute("height", Math.max(Tq, Tk) * ROW);
  const lines = makeSvg("g", { id: "lines" });
  svg.append(lines);
  const middle = (i) => i * ROW + ROW / 2;

  function addToken(side, i, label, tip) {
    const left = side === "q";
    const token = makeSvg("g", { class: `token ${side}`, "data-index": i });
    token.append(makeSvg("title", {}, tip));
    token.append(makeSvg("rect", { x: left ? 0 : LABEL + GAP, y: i * ROW, width: LABEL, height: ROW }));
    const x = left ? LABEL - 8 : LABEL + GAP + 8;
    const anchor = left ? "end" : "start";
    token.append(makeSvg("text", { x, y: middle(i), "text-anchor": anchor }, shorten(label)));
    token.addEventListener("mouseenter", () => {
      state.hover = { side, index: i };
      showFocus();
    });
    token.addEventListener("mouseleave", () => {
      state.hover = null;
      showFocus();
    });
    token.addEventListener("click", () => { // pick the token, or drop it when picked already
      state.token = same(state.token, { side, index: i }) ? null : { side, index: i };
      update();
    });
    svg.append(token);
  }
  data.queries.forEach((t, i) => addToken("q", i, t, `${t}\nquery row ${i}, position ${data.rows[i]}`));
  data.keys.forEach((t, j) => addToken("k", j, t, `${t}\nkey ${j}`));

  // a line from query i to key j per visible head, its opacity the weight; with a token picked,
  // only that token's lines
  function drawLines() {
    lines.replaceChildren();
    const t = state.token;
    data.heads.forEach((_, h) => {
      if (!state.heads[h]) return;
      for (let i = 0; i < Tq; i++) {
        if (t !== null && t.side === "q" && t.index !== i) continue;
        for (let j = 0; j < Tk; j++) {
          if (t !== null && t.side === "k" && t.index !== j) continue;
          const w = weight(state.layer, h, i, j);
          if (w < MIN_WEIGHT) continue;
          lines.append(makeSvg("line", {
            class: "attn", x1: LABEL, y1: middle(i), x2: LABEL + GAP, y2: middle(j),
            stroke: colours[h], "stroke-opacity": w.toFixed(4), "data-q": i, "data-k": j, "data-h": h,
          }));
        }
      }
    });
  }

  // the picked token is marked; the one under the pointer keeps its own lines, the rest fade
  function showFocus() {
    const f = state.hover;
    for (const token of svg.querySelectorAll(".token")) {
      const me = { side: token.classList.contains("q") ? "q" : "k", index: Number(token.dataset.index) };
      token.classList.toggle("focus", same(f, me));
      token.classList.toggle("picked", same(state.token, me));
    }
    for (const line of lines.children) {
      line.classList.toggle("dim", f !== null && Number(line.dataset[f.side]) !== f.index);
    }
  }

  // ---- colours of the heat maps: white 0, the head's own colour 1
  function rgbOf(colour) { // the sRGB bytes of a CSS colour, read back from one painted pixel
    const ctx = make("canvas", { width: 1, height: 1 }).getContext("2d");
    ctx.fillStyle = colour;
    ctx.fillRect(0, 0, 1, 1);
    return ctx.getImageData(0, 0, 1, 1).data;
  }
  const rgb = colours.map(rgbOf);

  function paint(canvas, l, h) {
    const ctx = canvas.getContext("2d");
    const image = ctx.createImageData(Tk, Tq); // one pixel per weight, row i = query i
    const stored = data.weights[l][h];
    for (let p = 0; p < stored.length; p++) {
      const a = Math.min(1, stored[p] / data.scale);
      for (let c = 0; c < 3; c++) image.data[4 * p + c] = Math.round(255 - a * (255 - rgb[h][c]));
      image.data[4 * p + 3] = 255;
    }
    ctx.putImageData(image, 0, 0);
  }

  // ---- the heat map of the layer shown and its first head shown, the tokens along its axes:
  // queries down the left, keys under it (every k-th where they would not fit)
  const heat = document.getElementById("heat-map");
  const px = Math.max(HEAT.least, Math.min(HEAT.most, Math.floor(HEAT.span / Math.max(Tq, Tk))));
  const every = Math.ceil((HEAT.font + 3) / px); // label every k-th token
  const room = (labels) => Math.min(HEAT.label, 10 + 7 * Math.max(...labels.map((t) => shorten(t).length)));
  const left = room(data.queries); // px for the query labels, and under the map for the keys'
  heat.setAttribute("width", left + Tk * px + 8);
  heat.setAttribute("height", Tq * px + room(data.keys) + 8);
  const heatCanvas = make("canvas", { width: Tk, height: Tq });
  const heatImage = makeSvg("image", {
    x: left, y: 0, width: Tk * px, height: Tq * px, preserveAspectRatio: "none",
  });
  const heatMark = makeSvg("g", { class: "marks" });
  heat.append(heatImage, heatMark);
  data.queries.forEach((t, i) => {
    if (i % every) return;
    heat.append(makeSvg("text", {
      class: "heat-label q", x: left - 6, y: i * px + px / 2, "text-anchor": "end", "data-index": i,
    }, shorten(t)));
  });
  data.keys.forEach((t, j) => {
    if (j % every) return;
    const x = left + j * px + px / 2;
    const y = Tq * px + 6;
    heat.append(makeSvg("text", {
      class: "heat-label k", x, y, "text-anchor": "end", transform: `rotate(-90 ${x} ${y})`,
      "data-index": j,
    }, shorten(t)));
  });
  const heatTip = makeSvg("title", {}, "");
  heat.append(heatTip);
  heat.addEventListener("mousemove", (event) => {
    const box = heatImage.getBoundingClientRect();
    const j = Math.floor((event.clientX - box.left) / px);
    const i = Math.floor((event.clientY - box.top) / px);
    if (i < 0 || j < 0 || i >= Tq || j >= Tk) return;
    const h = heatHead();
    heatTip.textContent = `${data.queries[i]} → ${data.keys[j]}: ${weight(state.layer, h, i, j).toFixed(4)}`;
  });

  const heatHead = () => Math.max(0, state.heads.indexOf(true)); // the first shown (none: 0)

  function drawHeat() {
    const h = heatHead();
    paint(heatCanvas, state.layer, h);
    heatImage.setAttribute("href", heatCanvas.toDataURL("image/png"));
    document.getElementById("heat-title").textContent =
      `${data.layers[state.layer]} · ${data.head_labels[h]}`;
    heatMark.replaceChildren(); // the picked token's row (a query) or column (a key)
    const t = state.token;
    if (t !== null) {
      const row = t.side === "q";
      heatMark.append(makeSvg("rect", {
        x: row ? left : left + t.index * px, y: row ? t.index * px : 0,
        width: row ? Tk * px : px, height: row ? px : Tq * px,
      }));
    }
    for (const label of heat.querySelectorAll(".heat-label")) {
      const side = label.classList.contains("q") ? "q" : "k";
      label.classList.toggle("picked", same(t, { side, index: Number(label.dataset.index) }));
    }
  }

  // ---- model view: a heat map per layer (down) and head (across), on the same scale
  const grid = document.getElementById("model-view");
  grid.style.gridTemplateColumns = `auto repeat(${H}, auto)`;
  const cellPx = CELL / Math.max(Tq, Tk); // css pixels per weight

  grid.append(make("span"));
  data.head_labels.forEach((label) => grid.append(make("span", { class: "label head-label" }, label)));
  const cells = [];
  data.layers.forEach((name, l) => {
    grid.append(make("span", { class: "label" }, name));
    data.heads.forEach((head, h) => {
      const cell = make("canvas", {
        class: "cell", width: Tk, height: Tq, "data-layer": l, "data-head": h,
        title: `${name}, ${data.head_labels[h]}: click to show it in the head view`,
      });
      cell.style.width = `${Math.max(4, Math.round(Tk * cellPx))}px`;
      cell.style.height = `${Math.max(4, Math.round(Tq * cellPx))}px`;
      paint(cell, l, h);
      cell.addEventListener("click", () => showHead(l, h));
      grid.append(cell);
      cells.push(cell);
    });
  });

  // a click on a heat map: the head view shows that layer, and that head alone
  function showHead(l, h) {
    state.layer = l;
    state.heads = data.heads.map((_, k) => k === h);
    state.mode = "one";
    update();
    svg.scrollIntoView({ block: "nearest" });
  }

  function update() {
    select.value = String(state.layer);
    tokenMenu.value = state.token === null ? "" : `${state.token.side}:${state.token.index}`;
    boxes.forEach((box, h) => { box.checked = state.heads[h]; });
    modes.forEach((radio) => { radio.checked = radio.value === state.mode; });
    drawLines();
    showFocus();
    drawHeat();
    for (const cell of cells) {
      const shown = Number(cell.dataset.layer) === state.layer && state.heads[Number(cell.dataset.head)];
      cell.classList.toggle("selected", shown);
    }
  }

  update();
  document.documentElement.dataset.ready = "true"; // the page is drawn (tests wait for this)
})();
