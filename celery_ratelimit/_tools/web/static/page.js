// The operator's page: polls /api/keys every second and draws what it answers. Plain
// JavaScript, no build step; every text from Redis goes in through textContent.
"use strict";
const $ = (id) => document.getElementById(id);
const state = { search: "", cursors: [0], doc: null, resetArmed: null };

const fromHash = new URLSearchParams(location.hash.slice(1)).get("token");
if (fromHash) {
  sessionStorage.setItem("crl-token", fromHash);
  history.replaceState(null, "", location.pathname);
}
$("token").value = sessionStorage.getItem("crl-token") || "";
$("token").addEventListener("change", () => sessionStorage.setItem("crl-token", $("token").value));

function headers() {
  const token = $("token").value;
  return token ? { "X-Ratelimit-Token": token } : {};
}

function seconds(s) {
  if (s === null || s === undefined) return "-";
  if (s <= 0) return "now";
  if (s < 120) return "in " + s.toFixed(1) + "s";
  if (s < 7200) return "in " + (s / 60).toFixed(1) + "m";
  return "in " + (s / 3600).toFixed(1) + "h";
}

function windowText(w) {
  if (!w) return "-";
  for (const [unit, n] of [["d", 86400], ["h", 3600], ["m", 60]]) {
    if (w % n === 0) return w / n + unit;
  }
  return w + "s";
}

function cell(tr, text, cls) {
  const td = document.createElement("td");
  td.textContent = text;
  if (cls) td.className = cls;
  tr.appendChild(td);
  return td;
}

function settingsText(s) {
  const parts = [];
  if (s.paused_for_s > 0) parts.push("paused " + seconds(s.paused_for_s).replace("in ", "") + " left");
  if (s.override) {
    const until = s.override_for_s === null ? "until unset" : "ends " + seconds(s.override_for_s);
    parts.push("override " + s.override + " (" + until + ")");
  }
  for (const u of s.upstream) {
    let text = "upstream " + u.algorithm + " " + windowText(u.window_s) + ":";
    if (u.reset_in_s) text += " " + u.remaining + " left, full again " + seconds(u.reset_in_s);
    if (u.quota) text += (u.reset_in_s ? "," : "") + " quota " + u.quota;
    parts.push(text);
  }
  for (const e of s.effective) {
    parts.push("adapting " + e.algorithm + " " + windowText(e.window_s) + ": effective " + e.limit);
  }
  return parts.join(" · ");
}

function limitRow(key, row) {
  const tr = document.createElement("tr");
  tr.dataset.key = key;
  tr.dataset.alg = row.algorithm;
  const k = cell(tr, key, "key");
  k.addEventListener("click", () => { $("act-key").value = key; });
  cell(tr, windowText(row.window_s), "window");
  cell(tr, row.algorithm, "alg");
  const used = row.limit === null ? String(row.used) : row.used + "/" + row.limit;
  cell(tr, used, row.limit !== null && row.used >= row.limit ? "used full" : "used");
  cell(tr, row.remaining === null ? "?" : String(row.remaining), "remaining");
  const units = row.reserved !== row.reservations ? " (" + row.reserved + " units)" : "";
  cell(tr, row.reservations + units, "backlog");
  cell(tr, row.drains_in_s ? seconds(row.drains_in_s) : "-", "drains");
  cell(tr, row.next_free_s === null ? "?" : seconds(row.next_free_s), "next");
  const leases = row.leases_s.map((s) => s.toFixed(0) + "s").join(", ");
  cell(tr, row.algorithm === "conc" ? row.used + (leases ? " (" + leases + ")" : "") : "", "leases");
  const waiting = Object.entries(row.waiting).map(([v, n]) => v + " " + n).join(", ");
  cell(tr, waiting, "waiting");
  let label = row.declared ? row.declared + " (" + row.sources.join(", ") + ")" : "not declared";
  if (row.override) label += "; overridden: " + row.override;
  cell(tr, label, "declared");
  return tr;
}

function drawRows(doc) {
  const body = $("rows");
  const rows = [];
  for (const fam of doc.families) {
    const tr = document.createElement("tr");
    tr.className = "family";
    const td = cell(tr, fam.family + " — " + fam.keys.length + " key(s)");
    td.colSpan = 11;
    rows.push(tr);
    for (const entry of fam.keys) {
      if (entry.settings) {
        const st = document.createElement("tr");
        st.className = "settings";
        st.dataset.key = entry.key;
        cell(st, entry.key, "key").addEventListener("click", () => { $("act-key").value = entry.key; });
        const s = cell(st, settingsText(entry.settings), "state");
        s.colSpan = 10;
        rows.push(st);
      }
      for (const row of entry.limits) rows.push(limitRow(entry.key, row));
    }
  }
  body.replaceChildren(...rows);
}

function drawChart(grants) {
  const svg = $("chart");
  const w = 640, h = 110, top = Math.max(1, ...grants);
  const step = w / grants.length;
  const points = grants.map((g, i) => (i * step).toFixed(1) + "," + (h - 12 - (g / top) * (h - 24)).toFixed(1));
  const ns = "http://www.w3.org/2000/svg";
  const line = document.createElementNS(ns, "polyline");
  line.setAttribute("points", points.join(" "));
  line.setAttribute("fill", "none");
  line.setAttribute("stroke", "#2a62c9");
  const label = document.createElementNS(ns, "text");
  label.setAttribute("x", 4);
  label.setAttribute("y", 12);
  label.textContent = "max " + top + "/s · last full second " + grants[grants.length - 2] + "/s";
  svg.replaceChildren(line, label);
  svg.dataset.total = grants.reduce((a, b) => a + b, 0);
}

function draw(doc) {
  $("where").textContent = doc.where || "";
  $("error").textContent = doc.error || "";
  $("actions").hidden = !doc.actions;
  if (doc.error) return; // keep the last table: the line above says why it is not live
  state.doc = doc;
  const page = state.cursors.length;
  $("paging").textContent = "page " + page + (doc.next ? "" : " (last)") + " · names looked at ~" + doc.scanned;
  $("prev").disabled = page === 1;
  $("next").disabled = !doc.next;
  drawRows(doc);
  drawChart(doc.grants);
}

async function poll() {
  const started = performance.now();
  const query = new URLSearchParams({ search: state.search, cursor: state.cursors[state.cursors.length - 1] });
  try {
    const answer = await fetch("/api/keys?" + query, { headers: headers() });
    draw(await answer.json());
  } catch (err) {
    draw({ where: $("where").textContent, error: "error: the page's server does not answer (" + err + ")" });
  }
  setTimeout(poll, Math.max(100, 1000 - (performance.now() - started))); // once a second
}

let typing = null;
$("search").addEventListener("input", () => {
  clearTimeout(typing);
  typing = setTimeout(() => { state.search = $("search").value.trim(); state.cursors = [0]; }, 250);
});
$("next").addEventListener("click", () => { if (state.doc && state.doc.next) state.cursors.push(state.doc.next); });
$("prev").addEventListener("click", () => { if (state.cursors.length > 1) state.cursors.pop(); });

async function act(action, button) {
  const key = $("act-key").value.trim();
  if (action === "reset" && state.resetArmed !== key) {
    state.resetArmed = key;
    button.textContent = "reset " + key + "? click again";
    setTimeout(() => { state.resetArmed = null; button.textContent = "reset"; }, 4000);
    return;
  }
  state.resetArmed = null;
  button.textContent = action;
  const body = { key, seconds: $("act-seconds").value, rate: $("act-rate").value, ttl: $("act-ttl").value };
  const answer = await fetch("/api/action/" + action, {
    method: "POST",
    headers: { "Content-Type": "application/json", ...headers() },
    body: JSON.stringify(body),
  });
  const result = await answer.json();
  $("result").textContent = result.ok ? result.lines.join("\n") : result.error;
  $("result").dataset.ok = result.ok ? "1" : "0";
}
for (const button of document.querySelectorAll("#actions button")) {
  button.addEventListener("click", () => act(button.dataset.action, button));
}
poll();
