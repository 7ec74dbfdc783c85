// Shoal admin dashboard (issue 9). Plain ES2020, no build step, nothing from another origin.
//
// Data flow: GET /api/status once for a first picture, GET /api/steps?from=0 once for the whole
// loss curve, then Server-Sent Events from /api/stream: one Status per change and at least every
// two seconds. The curve grows from the steps each Status carries (its most recent 200); a gap
// (the tab slept) is filled from /api/steps?from=N. /api/checkpoints is read on load and again
// whenever a checkpoint.* event arrives.
//
// Every string from the server reaches the page as text (textContent, text nodes, attributes),
// never through the HTML parser: web_test.go rejects the calls that would.
'use strict';

(() => {
  const $ = (id) => document.getElementById(id);

  // ---- state ---------------------------------------------------------------------------------

  const S = {
    status: null,       // the last Status
    jobId: null,
    curve: [],          // [{step, loss, val, tps}], by step
    curveIndex: new Map(), // step → index in curve
    curveLoaded: false,
    curveLoading: false,
    events: new Map(),  // event id → event
    eventsPrimed: false,
    heard: new Map(),   // peer id → last_heard (ms since epoch)
    skew: 0,            // server clock − browser clock, when the Status says (its "now")
    lastMessage: 0,
    connState: '',
    logSteps: false,
    hover: null,        // index into curve under the pointer
    drawQueued: false,
    mapSig: '',
    stagesSig: '',
    creditsSig: '',
    bansSig: '',
  };

  const now = () => Date.now() + S.skew;

  // ---- formatting ----------------------------------------------------------------------------

  function h(tag, props, ...kids) {
    const e = document.createElement(tag);
    if (props) {
      for (const [k, v] of Object.entries(props)) {
        if (v == null || v === false) continue;
        if (k === 'class') e.className = v;
        else if (k === 'text') e.textContent = v;
        else e.setAttribute(k, v === true ? '' : String(v));
      }
    }
    for (const c of kids.flat()) {
      if (c == null || c === false) continue;
      e.append(c instanceof Node ? c : String(c)); // a string becomes a text node
    }
    return e;
  }

  const isNum = (x) => typeof x === 'number' && Number.isFinite(x);
  // classToken makes a server string usable as one class name: a peer's kind or backend cannot
  // then add classes of its choosing (hidden, danger…) to the page.
  const classToken = (x) => String(x ?? '').replace(/[^A-Za-z0-9_-]/g, '');

  function trimNum(v) {
    const a = Math.abs(v);
    return a >= 100 ? v.toFixed(0) : a >= 10 ? v.toFixed(1) : v.toFixed(2);
  }

  // fmtNum writes 1234567 as 1.23M.
  function fmtNum(x) {
    if (!isNum(x)) return '—';
    const a = Math.abs(x);
    for (const [d, u] of [[1e12, 'T'], [1e9, 'G'], [1e6, 'M'], [1e3, 'k']]) {
      if (a >= d) return trimNum(x / d) + u;
    }
    return Number.isInteger(x) ? String(x) : trimNum(x);
  }

  function fmtBytes(n) {
    if (!isNum(n)) return '—';
    const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
    let i = 0;
    while (Math.abs(n) >= 1024 && i < units.length - 1) { n /= 1024; i++; }
    return (i === 0 ? String(n) : trimNum(n)) + ' ' + units[i];
  }

  const fmtLoss = (x) => (isNum(x) ? x.toFixed(4) : '—');

  function fmtMs(ms) {
    if (!isNum(ms)) return '—';
    return ms >= 1000 ? (ms / 1000).toFixed(2) + ' s' : ms.toFixed(ms >= 100 ? 0 : 1) + ' ms';
  }

  function fmtAgo(ms) {
    if (!isNum(ms)) return '—';
    const s = Math.max(0, ms) / 1000;
    if (s < 10) return s.toFixed(1) + ' s ago';
    if (s < 60) return Math.round(s) + ' s ago';
    if (s < 3600) return Math.round(s / 60) + ' min ago';
    if (s < 86400) return (s / 3600).toFixed(1) + ' h ago';
    return (s / 86400).toFixed(1) + ' d ago';
  }

  function fmtSteps(v) {
    if (v >= 1e6) return +(v / 1e6).toPrecision(3) + 'M';
    if (v >= 1e4) return +(v / 1e3).toPrecision(3) + 'k';
    return String(v);
  }

  // parseTime returns ms since the epoch, or null for a missing or zero Go time.
  function parseTime(s) {
    if (typeof s !== 'string') return null;
    const t = Date.parse(s);
    return Number.isFinite(t) && t > 0 ? t : null;
  }

  function fmtClock(t) {
    if (t == null) return '—';
    const d = new Date(t);
    const sameDay = d.toDateString() === new Date().toDateString();
    const hms = d.toLocaleTimeString([], { hour: '2-digit', minute: '2-digit', second: '2-digit', hour12: false });
    return sameDay ? hms : d.toLocaleDateString([], { month: 'short', day: 'numeric' }) + ' ' + hms;
  }

  const fullTime = (t) => (t == null ? '' : new Date(t).toString());
  // Job ids are time-ordered UUIDs (v7): their first digits are a timestamp, so the last ones
  // tell jobs apart.
  const shortId = (id) => (typeof id === 'string' && id.length > 10 ? id.slice(-8) : String(id ?? ''));

  // ---- peers and roles -----------------------------------------------------------------------

  function peersById(st) {
    const m = new Map();
    for (const p of st.peers || []) m.set(p.id, p);
    return m;
  }

  function peerLabel(st, id, nameHint) {
    const p = (st.peers || []).find((q) => q.id === id);
    return (p && p.name) || nameHint || shortId(id);
  }

  // replicaOf is the pipeline replica a stage of the plan belongs to (0 in a plan of one).
  const replicaOf = (s) => (isNum(s.replica) ? s.replica : 0);

  // replicated reports whether the plan runs several pipeline replicas.
  const replicated = (plan) => !!plan && isNum(plan.replicas) && plan.replicas > 1;

  // stageLabels names the plan's stages as the map numbers them: "stage 2" in a plan of one
  // pipeline, "r1 stage 0" (replica 1's first stage) in a plan of several.
  function stageLabels(plan) {
    const stages = (plan && plan.stages) || [];
    if (!replicated(plan)) return stages.map((s, i) => 'stage ' + i);
    let i = 0;
    return stages.map((s, k) => {
      if (k > 0 && replicaOf(s) !== replicaOf(stages[k - 1])) i = 0;
      return 'r' + replicaOf(s) + ' stage ' + i++;
    });
  }

  // roles maps a peer id to what the plan gives it: "stage 2" (or "r1 stage 0"), "experts b3",
  // "standby".
  function roles(st) {
    const m = new Map();
    const add = (id, r) => m.set(id, m.has(id) ? m.get(id) + ', ' + r : r);
    const plan = st.plan;
    if (!plan) return m;
    const labels = stageLabels(plan);
    (plan.stages || []).forEach((s, i) => add(s.peer, labels[i]));
    for (const e of plan.expert_hosts || []) add(e.peer, 'experts b' + e.block);
    for (const id of plan.standby || []) add(id, 'standby');
    return m;
  }

  function healthClass(t) {
    if (t == null) return 'bad';
    const age = now() - t;
    return age < 5000 ? 'ok' : age < 15000 ? 'warn' : 'bad';
  }

  // heardDot and heardText are refreshed every second by refreshAges, from S.heard.
  function heardDot(id) {
    const t = S.heard.get(id);
    return h('i', { class: 'dot ' + healthClass(t), 'data-peer': id, title: t == null ? 'never heard' : 'last heard ' + fmtAgo(now() - t) });
  }

  function refreshAges() {
    for (const el of document.querySelectorAll('.dot[data-peer]')) {
      const t = S.heard.get(el.getAttribute('data-peer'));
      el.className = 'dot ' + healthClass(t);
      el.title = t == null ? 'never heard' : 'last heard ' + fmtAgo(now() - t);
    }
    for (const el of document.querySelectorAll('.heard[data-peer]')) {
      const t = S.heard.get(el.getAttribute('data-peer'));
      el.textContent = t == null ? 'never' : fmtAgo(now() - t);
    }
    if (S.connState === 'live' && Date.now() - S.lastMessage > 7000) setConn('stale');
  }

  // ---- network -------------------------------------------------------------------------------

  class HTTPError extends Error {
    constructor(status, message) { super(message); this.status = status; }
  }

  async function errorOf(r) {
    let msg = r.status + ' ' + r.statusText;
    try {
      const j = await r.json();
      if (j && typeof j.error === 'string') msg = j.error;
    } catch (_) { /* not JSON: keep the status line */ }
    return new HTTPError(r.status, msg);
  }

  async function getJSON(path) {
    const r = await fetch(path, { credentials: 'same-origin', headers: { Accept: 'application/json' }, cache: 'no-store' });
    if (!r.ok) throw await errorOf(r);
    return r.json();
  }

  let toastTimer = 0;
  function toast(msg, kind, signIn) {
    const t = $('toast');
    t.replaceChildren(msg);
    if (signIn) t.append(' — ', h('a', { href: 'login' }, 'sign in again'));
    t.className = 'toast ' + (kind || '');
    t.hidden = false;
    clearTimeout(toastTimer);
    toastTimer = setTimeout(() => { t.hidden = true; }, kind === 'err' ? 9000 : 4000);
  }

  // act POSTs an admin action: the session cookie rides along (same origin), and X-Shoal-Action
  // tells the server a page of ours sent it, not a cross-site form.
  async function act(path, label, button) {
    if (button) button.disabled = true;
    try {
      const r = await fetch(path, { method: 'POST', credentials: 'same-origin', headers: { 'X-Shoal-Action': '1' } });
      if (!r.ok) throw await errorOf(r);
      toast(label + ': done', 'ok');
      if (path === '/api/checkpoint') loadCheckpoints();
    } catch (e) {
      toast(label + ' failed: ' + e.message, 'err', e.status === 401);
    } finally {
      if (button) button.disabled = false;
      if (S.status) renderHeader(S.status); // the job state decides which buttons are live
    }
  }

  function setConn(state) {
    S.connState = state;
    const el = $('conn');
    el.className = 'conn ' + state;
    el.textContent = { live: 'live', stale: 'stale', reconnecting: 'reconnecting…', offline: 'offline', polling: 'polling' }[state] || state;
  }

  function startStream() {
    if (!('EventSource' in window)) { // very old browsers: poll instead
      setConn('polling');
      setInterval(() => getJSON('/api/status').then(onStatus).catch(() => {}), 2000);
      return;
    }
    const es = new EventSource('/api/stream');
    es.addEventListener('status', (ev) => {
      S.lastMessage = Date.now();
      if (S.connState !== 'live') setConn('live');
      let st;
      try { st = JSON.parse(ev.data); } catch (e) { console.error('bad status message', e); return; }
      onStatus(st);
    });
    es.onopen = () => setConn('live');
    es.onerror = () => {
      if (es.readyState === EventSource.CLOSED) {
        // The server answered with something other than a stream (401, 5xx): EventSource gives
        // up on those, so try again ourselves, and find out whether we were signed out.
        setConn('offline');
        es.close();
        setTimeout(startStream, 5000);
        getJSON('/api/status').catch((e) => { if (e.status === 401) toast('Signed out', 'err', true); });
      } else {
        setConn('reconnecting');
      }
    };
  }

  async function loadCurve(from) {
    if (S.curveLoading) return;
    S.curveLoading = true;
    const job = S.jobId;
    try {
      const list = await getJSON('/api/steps?from=' + encodeURIComponent(from));
      if (job === null || job === S.jobId) {
        if (Array.isArray(list)) mergeSteps(list);
        S.curveLoaded = true;
        scheduleDraw();
      }
    } catch (e) {
      console.error('load steps', e); // onStatus tries again
    } finally {
      S.curveLoading = false;
    }
  }

  let checkpointsSeq = 0;
  async function loadCheckpoints() {
    const seq = ++checkpointsSeq;
    try {
      const list = await getJSON('/api/checkpoints');
      if (seq !== checkpointsSeq) return;
      renderCheckpoints(Array.isArray(list) ? list : []);
      // A sample needs a complete checkpoint: asking before there is one is a 404 (which the
      // browser reports as an error on the console).
      if (Array.isArray(list) && list.some((ck) => ck.state === 'complete')) loadSample();
    } catch (e) {
      if (seq === checkpointsSeq) renderCheckpointsError(e);
    }
  }

  // ---- sample and jobs -------------------------------------------------------------------------

  let sampleSeq = 0;
  async function loadSample() {
    const seq = ++sampleSeq;
    try {
      const r = await fetch('/api/sample', { credentials: 'same-origin', cache: 'no-store' });
      if (!r.ok) return; // no checkpoint yet: keep the placeholder
      const j = await r.json();
      if (seq !== sampleSeq || !j || typeof j.text !== 'string') return;
      $('sample').textContent = j.text;
      $('sample').className = 'sample';
      $('sample-step').textContent = 'after step ' + j.step;
    } catch (e) {
      console.error('load sample', e);
    }
  }

  async function loadJobs() {
    try {
      const list = await getJSON('/api/jobs');
      const body = $('jobs').tBodies[0];
      body.replaceChildren(...(Array.isArray(list) ? list : []).slice().reverse().map((j) => {
        const cancel = h('button', { type: 'button', 'data-job': j.id }, 'Cancel');
        cancel.disabled = !['queued', 'running', 'paused'].includes(j.state);
        return h('tr', null,
          h('td', { title: j.id }, shortId(j.id)), h('td', null, j.state),
          h('td', { class: 'num' }, String(j.step) + '/' + String(j.steps)),
          h('td', null, j.private ? 'yes' : 'no'), h('td', null, cancel));
      }));
    } catch (e) {
      console.error('load jobs', e);
    }
  }

  async function submitJob(ev) {
    ev.preventDefault();
    const priv = $('job-private').checked;
    try {
      const r = await fetch('/api/jobs' + (priv ? '?private=1' : ''), {
        method: 'POST', credentials: 'same-origin',
        headers: { 'X-Shoal-Action': '1', 'Content-Type': 'application/json' },
        body: $('job-spec').value,
      });
      if (!r.ok) throw await errorOf(r);
      const j = await r.json();
      // A model the connected workers cannot hold is queued with a warning (POST /api/jobs).
      toast('job ' + shortId(j.id) + ' queued' + (j.warning ? '; warning: ' + j.warning : ''), j.warning ? 'err' : 'ok');
      $('job-link').textContent = j.join_link ? 'Join link: ' + j.join_link + ' — native workers: ' + j.worker_command : '';
      loadJobs();
    } catch (e) {
      toast('submit failed: ' + e.message, 'err', e.status === 401);
    }
  }

  function onJobsClick(ev) {
    const b = ev.target.closest('button[data-job]');
    if (!b) return;
    const id = b.getAttribute('data-job');
    if (!window.confirm('Cancel job ' + shortId(id) + '? A cancelled job does not run again; its checkpoints stay.')) return;
    act('/api/jobs/' + encodeURIComponent(id) + '/cancel', 'cancel', b).then(loadJobs);
  }

  // ---- status --------------------------------------------------------------------------------

  function onStatus(st) {
    if (!st || typeof st !== 'object') return;
    const job = st.job || null;
    if (job && S.jobId && job.id !== S.jobId) resetJob();
    if (job) S.jobId = job.id;
    S.status = st;
    const serverNow = parseTime(st.now);
    if (serverNow != null) S.skew = serverNow - Date.now();

    S.heard = new Map((st.peers || []).map((p) => [p.id, parseTime(p.last_heard)]));

    const steps = Array.isArray(st.steps) ? st.steps : [];
    if (steps.length) truncateCurve(steps[steps.length - 1].step);
    const last = S.curve.length ? S.curve[S.curve.length - 1].step : null;
    if (S.curveLoaded && last != null && steps.length && steps[0].step > last + 1) loadCurve(last + 1);
    mergeSteps(steps);
    if (!S.curveLoaded) loadCurve(0);

    const run = (name, f) => { try { f(st); } catch (e) { console.error('render ' + name, e); } };
    run('header', renderHeader);
    run('throughput', renderThroughput);
    run('stages', renderStageTimes);
    run('map', renderMap);
    run('peers', renderPeers);
    run('credits', renderCredits);
    run('audit', renderAudit);
    run('bans', renderBans);
    run('events', renderEvents);
    scheduleDraw();
  }

  function resetJob() {
    S.curve = [];
    S.curveIndex = new Map();
    S.curveLoaded = false;
    S.events = new Map();
    S.eventsPrimed = false;
    S.hover = null;
    $('events').replaceChildren();
    loadCheckpoints();
  }

  // truncateCurve drops the points after step: the job went back to a checkpoint (a restart, a
  // recovery) and will record those steps again.
  function truncateCurve(step) {
    let n = S.curve.length;
    while (n > 0 && S.curve[n - 1].step > step) n--;
    if (n === S.curve.length) return;
    for (const p of S.curve.splice(n)) S.curveIndex.delete(p.step);
    S.hover = null;
    scheduleDraw();
  }

  function mergeSteps(list) {
    let changed = false;
    let unordered = false;
    for (const s of list) {
      if (!s || !isNum(s.step)) continue;
      const p = { step: s.step, loss: s.loss, val: isNum(s.val_loss) ? s.val_loss : null, tps: s.tokens_per_s };
      const i = S.curveIndex.get(s.step);
      if (i !== undefined) {
        const q = S.curve[i];
        if (p.val == null) p.val = q.val;
        if (q.loss !== p.loss || q.val !== p.val) { S.curve[i] = p; changed = true; }
        continue;
      }
      if (S.curve.length && s.step < S.curve[S.curve.length - 1].step) unordered = true;
      S.curveIndex.set(s.step, S.curve.length);
      S.curve.push(p);
      changed = true;
    }
    if (unordered) {
      S.curve.sort((a, b) => a.step - b.step);
      S.curveIndex = new Map(S.curve.map((p, i) => [p.step, i]));
    }
    if (unordered) S.hover = null; // indices moved
    if (changed) scheduleDraw();
  }

  function latestVal() {
    for (let i = S.curve.length - 1; i >= 0; i--) if (S.curve[i].val != null) return S.curve[i];
    return null;
  }

  function stateClass(state) {
    return classToken(String(state || '').split(':')[0].trim().toLowerCase());
  }

  function renderHeader(st) {
    const job = st.job;
    const steps = st.steps || [];
    const lastStep = steps.length ? steps[steps.length - 1] : (S.curve.length ? S.curve[S.curve.length - 1] : null);
    $('job-id').textContent = job ? shortId(job.id) : 'no job';
    $('job-id').title = job ? job.id : '';
    const stEl = $('job-state');
    stEl.textContent = job ? job.state : '—';
    stEl.title = job ? job.state : '';
    stEl.className = 'state ' + (job ? stateClass(job.state) : '');
    $('step').textContent = job ? job.step + '/' + job.steps : '—';
    // Why the job waits for workers, as long as it does (JobStatus.waiting).
    const waiting = job && typeof job.waiting === 'string' ? job.waiting : '';
    $('waiting').textContent = waiting ? 'Waiting for workers: ' + waiting : '';
    $('waiting').hidden = !waiting;
    $('loss').textContent = lastStep ? fmtLoss(lastStep.loss) : '—';
    const v = latestVal();
    $('val-loss').textContent = v ? fmtLoss(v.val) : '—';
    $('val-loss').title = v ? 'at step ' + v.step : '';
    const tps = lastStep ? (isNum(lastStep.tokens_per_s) ? lastStep.tokens_per_s : lastStep.tps) : null;
    $('tps').textContent = fmtNum(tps);

    const state = job ? stateClass(job.state) : '';
    const over = state === 'done' || state === 'cancelled';
    $('btn-pause').disabled = !job || over || state === 'paused';
    $('btn-resume').disabled = !job || over || state === 'running';
    $('btn-checkpoint').disabled = !job || over;
  }

  function renderThroughput(st) {
    const vals = (st.steps || []).map((s) => s.tokens_per_s).filter(isNum);
    $('tps-big').textContent = vals.length ? fmtNum(vals[vals.length - 1]) : '—';
    S.spark = vals;
    if (vals.length) {
      const lo = Math.min(...vals), hi = Math.max(...vals);
      $('tps-range').textContent = 'last ' + vals.length + ' steps: min ' + fmtNum(lo) + ', max ' + fmtNum(hi);
    }
  }

  function roleOfTimedPeer(st, id, i) {
    const plan = st.plan;
    if (plan) {
      const k = (plan.stages || []).findIndex((s) => s.peer === id);
      if (k >= 0) return stageLabels(plan)[k];
      const e = (plan.expert_hosts || []).find((x) => x.peer === id);
      if (e) return 'experts b' + e.block;
    }
    return '#' + i;
  }

  function renderStageTimes(st) {
    const box = $('stage-times');
    const steps = st.steps || [];
    let last = null;
    for (let i = steps.length - 1; i >= 0 && !last; i--) {
      if (Array.isArray(steps[i].stages) && steps[i].stages.length) last = steps[i];
    }
    if (!last) {
      if (S.stagesSig !== 'none') { box.replaceChildren(h('p', { class: 'muted' }, 'No step timed yet.')); S.stagesSig = 'none'; }
      return;
    }
    const sig = JSON.stringify([last.step, last.stages, st.plan && st.plan.version, (st.peers || []).map((p) => p.name)]);
    if (sig === S.stagesSig) return;
    S.stagesSig = sig;

    const rows = last.stages.map((s, i) => {
      const c = isNum(s.compute_ms) ? s.compute_ms : 0;
      const w = isNum(s.wait_ms) ? s.wait_ms : 0;
      const x = isNum(s.transfer_ms) ? s.transfer_ms : 0;
      return { role: roleOfTimedPeer(st, s.peer, i), name: peerLabel(st, s.peer), peer: s.peer, c, w, x, hasX: isNum(s.transfer_ms) };
    });
    const hasTransfer = rows.some((r) => r.hasX);
    $('key-transfer').hidden = !hasTransfer;
    const max = Math.max(1e-9, ...rows.map((r) => r.c + r.w + r.x));
    const seg = (cls, v) => {
      const e = h('span', { class: 'seg ' + cls });
      e.style.width = (100 * v / max).toFixed(3) + '%'; // CSSOM: allowed under style-src 'self'
      return e;
    };
    const out = [h('div', { class: 'muted small' }, 'step ' + last.step)];
    for (const r of rows) {
      const parts = ['compute ' + fmtMs(r.c), 'waiting ' + fmtMs(r.w)];
      if (r.hasX) parts.push('transfer ' + fmtMs(r.x));
      out.push(h('div', { class: 'bar-row', title: r.role + ' · ' + r.name + ' (' + r.peer + '): ' + parts.join(', ') },
        h('div', { class: 'bar-label' }, r.role, h('small', null, r.name)),
        h('div', { class: 'bar' }, seg('compute', r.c), seg('wait', r.w), r.hasX ? seg('transfer', r.x) : null),
        h('div', { class: 'bar-num' }, fmtMs(r.c + r.w + r.x))));
    }
    box.replaceChildren(...out);
  }

  // ---- pipeline and expert map ---------------------------------------------------------------

  function peerLine(st, id, nameHint) {
    const p = peersById(st).get(id);
    const kids = [heardDot(id), h('span', { class: 'name', title: id }, (p && p.name) || nameHint || shortId(id))];
    if (p) {
      if (p.kind) kids.push(h('span', { class: 'tag ' + classToken(p.kind) }, p.kind));
      if (p.backend) kids.push(h('span', { class: 'tag ' + classToken(p.backend), title: p.device || '' }, p.backend));
      if (p.device) kids.push(h('span', { class: 'muted' }, p.device));
      if (isNum(p.gflops) && p.gflops > 0) kids.push(h('span', { class: 'muted' }, fmtNum(p.gflops) + ' GFLOP/s'));
    } else {
      kids.push(h('span', { class: 'muted' }, 'not connected'));
    }
    return h('div', { class: 'peer-line' }, kids);
  }

  // stageBox draws stage i (its number within its pipeline) of the plan: its blocks, its peer,
  // and the hosts of its blocks' experts. It adds the peers it names to inPlan.
  function stageBox(st, s, i, inPlan) {
    const plan = st.plan;
    const hosts = plan.expert_hosts || [];
    const router = st.router || {};
    const [a, b] = Array.isArray(s.blocks) ? s.blocks : [0, 0]; // half-open: blocks a … b−1
    inPlan.add(s.peer);
    const mine = hosts.filter((e) => e.block >= a && e.block < b).sort((x, y) => x.block - y.block);
    const moe = new Set(mine.map((e) => e.block));
    const chips = [];
    for (let k = a; k < b; k++) chips.push(h('span', { class: 'chip' + (moe.has(k) ? ' moe' : ''), title: moe.has(k) ? 'MoE block ' + k : 'block ' + k }, 'b' + k));
    const experts = mine.map((e) => {
      inPlan.add(e.peer);
      const load = router[String(e.block)] || [];
      const ex = (e.experts || []).map((x) => {
        const n = load[x];
        return h('span', { class: 'chip moe', title: 'expert ' + x + ' of block ' + e.block + (isNum(n) ? ': ' + n + ' tokens routed last step' : '') },
          'e' + x + (isNum(n) ? ' · ' + fmtNum(n) : ''));
      });
      return h('div', { class: 'expert' },
        h('div', { class: 'what' }, 'block ' + e.block + ' experts'),
        peerLine(st, e.peer, e.peer_name),
        h('div', { class: 'chips' }, ex));
    });
    return h('div', { class: 'stage' },
      h('h3', null, 'Stage ' + i, h('small', null, b > a ? 'blocks ' + a + '–' + (b - 1) : 'no blocks')),
      h('div', { class: 'blocks' }, chips),
      peerLine(st, s.peer, s.peer_name),
      experts.length ? h('div', { class: 'experts' }, experts) : null);
  }

  // replicaRows draws a plan of several pipeline replicas: one row per replica (the stages come
  // replica after replica), headed by the replica's index and its micro-batches [a,b) of the
  // step's M.
  function replicaRows(st, inPlan) {
    const stages = st.plan.stages;
    const M = Math.max(0, ...stages.map((s) => (Array.isArray(s.micro_batches) && isNum(s.micro_batches[1]) ? s.micro_batches[1] : 0)));
    const rows = [];
    let cur = null;
    stages.forEach((s, k) => {
      if (!cur || replicaOf(s) !== replicaOf(stages[k - 1])) {
        cur = { replica: replicaOf(s), mbs: Array.isArray(s.micro_batches) ? s.micro_batches : null, boxes: [] };
        rows.push(cur);
      }
      cur.boxes.push(stageBox(st, s, cur.boxes.length, inPlan));
    });
    return rows.map((r) => {
      const n = r.mbs ? r.mbs[1] - r.mbs[0] : null;
      const own = st.plan.own_batches === true; // outer mode: a whole batch of its own each step
      let mbs = r.mbs ? 'micro-batches [' + r.mbs[0] + ',' + r.mbs[1] + ') of ' + M : 'micro-batches unknown';
      if (own) mbs = 'a batch of its own' + (isNum(n) ? ', ' + n + ' micro-batches' : '');
      const title = own ? 'trains every micro-batch of a batch of its own each step' : isNum(n) ? 'computes ' + n + ' of every step\'s ' + M + ' micro-batches' : null;
      return h('div', { class: 'replica', 'data-replica': r.replica },
        h('div', { class: 'replica-head', title },
          h('b', null, 'Replica ' + r.replica), h('span', { class: 'mbs' }, mbs),
          h('span', { class: 'muted' }, r.boxes.length === 1 ? '1 stage' : r.boxes.length + ' stages')),
        h('div', { class: 'pipeline' }, r.boxes));
    });
  }

  const syncWords = {
    step: 'gradients reduced across the replicas every step',
    outer: 'replicas train on their own and merge in outer rounds',
  };

  function renderMap(st) {
    const box = $('map');
    const plan = st.plan;
    // Rebuild only when what the map shows changed; health dots refresh in place.
    const sig = JSON.stringify([plan, st.router, (st.peers || []).map((p) => [p.id, p.name, p.kind, p.backend, p.device, p.gflops])]);
    if (sig === S.mapSig) return;
    S.mapSig = sig;
    const many = replicated(plan);
    $('plan-version').textContent = plan ? 'plan v' + plan.version + (many ? ' · ' + plan.replicas + ' pipeline replicas' : '') : '';
    if (!plan || !(plan.stages || []).length) {
      box.replaceChildren(h('p', { class: 'muted' }, plan ? 'The plan has no stages.' : 'No plan yet.'));
      return;
    }
    const inPlan = new Set();
    const boxes = many ? replicaRows(st, inPlan) : plan.stages.map((s, i) => stageBox(st, s, i, inPlan));
    const standby = plan.standby || [];
    standby.forEach((id) => inPlan.add(id));
    const idle = (st.peers || []).filter((p) => !inPlan.has(p.id));
    const side = [];
    if (many) {
      const sync = String(plan.sync || 'step');
      side.push(h('span', { class: 'sync', title: syncWords[sync] || null }, 'Sync: ' + sync));
      if (Array.isArray(plan.replica_steps) && plan.replica_steps.length > 1 && plan.replica_steps.every(isNum)) {
        side.push(h('span', { title: 'the step each replica computes: replicas run at their own pace between outer steps' },
          'Replicas at step ' + plan.replica_steps.map((s) => s + 1).join(', ')));
      }
      if (isNum(plan.warmup_until) && plan.warmup_until > 0) {
        side.push(h('span', { title: 'the synchronous warm-up: step mode, one optimiser for all replicas, until outer mode takes over' },
          'Warm-up: outer mode from step ' + (plan.warmup_until + 1)));
      }
      if (isNum(plan.delay) && plan.delay > 0) {
        side.push(h('span', { title: 'each outer step is exchanged while the replicas train on, and taken up this many inner steps later' },
          'Overlap: ' + plan.delay + ' steps'));
      }
    }
    if (isNum(plan.kept_from) && plan.kept_from > 0 && isNum(plan.from_step)) {
      side.push(h('span', { title: 'a worker left or joined: the workers whose stage did not move kept their shards, and nothing else was restored' },
        'Kept plan v' + plan.kept_from + ' from step ' + (plan.from_step + 1)));
    }
    if (plan.took_from && typeof plan.took_from === 'object') {
      for (const [taker, givers] of Object.entries(plan.took_from)) {
        // Several givers (comma-separated, in block order) where none held the stage's blocks whole.
        const from = String(givers).split(',').flatMap((g, i) => i ? [', ', peerLabel(st, g)] : [peerLabel(st, g)]);
        side.push(h('span', { class: 'peer-line', title: 'took up its stage\'s state from workers holding its blocks, peer to peer: no checkpoint' },
          peerLabel(st, taker), ' \u2190 ', ...from));
      }
    }
    if (Array.isArray(plan.pools)) {
      for (const pl of plan.pools) {
        if (!pl || !Array.isArray(pl.blocks) || !Array.isArray(pl.members)) continue;
        side.push(h('span', { title: 'workers holding the same blocks with the same state: losing one costs no restore while another survives' },
          'Pool [' + pl.blocks.join(',') + '): ' + pl.members.length + ' members'));
      }
    }
    if (isNum(plan.depth)) {
      side.push(h('span', { title: 'micro-batches each stage keeps in flight beyond 1F1B, to hide link latency' },
        'In flight: depth ' + plan.depth));
    }
    if (standby.length) side.push(h('span', null, 'Standby:'), ...standby.map((id) => h('span', { class: 'peer-line' }, heardDot(id), peerLabel(st, id))));
    if (idle.length) side.push(h('span', null, 'Not in the plan:'), ...idle.map((p) => h('span', { class: 'peer-line' }, heardDot(p.id), p.name || shortId(p.id))));
    if (side.length) boxes.push(h('div', { class: 'side' }, side));
    box.replaceChildren(...boxes);
  }

  // ---- peers table ---------------------------------------------------------------------------

  const peerRows = new Map(); // peer id → <tr>, kept across updates so buttons survive them

  function makePeerRow(id) {
    const td = (cls) => h('td', cls ? { class: cls } : null);
    const cells = {
      id: td('mono'), name: td(), kind: td(), backend: td(), gflops: td('num'), role: td(),
      joined: td(), heard: td(), micro: td('num'), sent: td('num'), act: td(),
    };
    cells.id.append(heardDot(id), h('span', { title: id }, shortId(id)));
    cells.heard.append(h('span', { class: 'heard', 'data-peer': id }));
    cells.act.append(h('div', { class: 'row-actions' },
      h('button', { type: 'button', class: 'small', 'data-act': 'drain', 'data-peer': id, title: 'ask it to finish and leave for good' }, 'Drain'),
      h('button', { type: 'button', class: 'small danger', 'data-act': 'kick', 'data-peer': id, title: 'drop it now (it may rejoin)' }, 'Kick')));
    const tr = h('tr', { 'data-peer': id }, Object.values(cells));
    tr._cells = cells;
    return tr;
  }

  function renderPeers(st) {
    const tbody = $('peers').tBodies[0];
    const role = roles(st);
    const peers = (st.peers || []).slice().sort((a, b) => {
      const ja = parseTime(a.joined) || 0, jb = parseTime(b.joined) || 0;
      return ja - jb || String(a.id).localeCompare(String(b.id));
    });
    $('peer-count').textContent = peers.length ? peers.length + ' connected' : '';
    const empty = tbody.querySelector('tr.empty-row');
    if (peers.length && empty) empty.remove();
    const seen = new Set();
    peers.forEach((p, i) => {
      seen.add(p.id);
      let tr = peerRows.get(p.id);
      if (!tr) { tr = makePeerRow(p.id); peerRows.set(p.id, tr); }
      const c = tr._cells;
      c.name.textContent = p.name || '—';
      c.kind.textContent = p.kind || '—';
      // textContent: the device name is the peer's own words.
      c.backend.textContent = (p.backend || '—') + (p.device ? ' (' + p.device + ')' : '');
      c.gflops.textContent = isNum(p.gflops) && p.gflops > 0 ? fmtNum(p.gflops) : '—';
      // A peer that delivered far below its claim is planned with what it delivered.
      if (p.flagged) {
        c.gflops.textContent += ' ⚑ ' + fmtNum(p.planned_gflops || 0);
        c.gflops.title = 'claimed ' + fmtNum(p.gflops) + ' GFLOP/s, delivered far less in its measured steps: planned with ' + fmtNum(p.planned_gflops || 0);
      } else {
        c.gflops.title = 'claimed by the peer; checked against its measured steps';
      }
      c.role.textContent = role.get(p.id) || (st.plan ? 'idle' : '—');
      const joined = parseTime(p.joined);
      c.joined.textContent = fmtClock(joined);
      c.joined.title = fullTime(joined);
      c.micro.textContent = isNum(p.micro_batches) ? p.micro_batches.toLocaleString() : '—';
      c.sent.textContent = fmtBytes(p.bytes_sent);
      c.sent.title = 'connection: ' + fmtBytes(p.bytes_in) + ' in, ' + fmtBytes(p.bytes_out) + ' out';
      if (tbody.children[i] !== tr) tbody.insertBefore(tr, tbody.children[i] || null); // move only when out of place
    });
    for (const [id, tr] of peerRows) {
      if (!seen.has(id)) { tr.remove(); peerRows.delete(id); }
    }
    if (!peers.length && !tbody.querySelector('tr.empty-row')) {
      tbody.append(h('tr', { class: 'empty-row' }, h('td', { class: 'empty', colspan: 11 }, 'No peer connected.')));
    }
    refreshAges();
  }

  function onPeersClick(ev) {
    const b = ev.target.closest('button[data-act]');
    if (!b) return;
    const id = b.getAttribute('data-peer');
    const what = b.getAttribute('data-act');
    const name = S.status ? peerLabel(S.status, id) : id;
    const ask = what === 'kick'
      ? 'Kick ' + name + '? It is dropped at once; its work is replanned, and it may rejoin.'
      : 'Drain ' + name + '? It is asked to finish cleanly and leave for good.';
    if (!window.confirm(ask)) return;
    act('/api/peers/' + encodeURIComponent(id) + '/' + what, (what === 'kick' ? 'Kick ' : 'Drain ') + name, b);
  }

  // ---- credit and verification ---------------------------------------------------------------

  // fmtGflop writes a GFLOP count with thousands separators and at most two decimals.
  const fmtGflop = (x) => (isNum(x) ? x.toLocaleString(undefined, { maximumFractionDigits: 2 }) : '—');
  const fmtCount = (x) => (isNum(x) ? x.toLocaleString() : '—');
  const fmtPct = (x) => (isNum(x) ? (100 * x).toLocaleString(undefined, { maximumFractionDigits: 2 }) + ' %' : '—');

  // renderCredits draws the leaderboard: the status's credits, one line per volunteer (its
  // identity, over its restarts and tabs; a worker without one has its own), most verified work
  // first (the server's order). The rows are rebuilt only when the list changed.
  function renderCredits(st) {
    const list = Array.isArray(st.credits) ? st.credits : [];
    const bans = Array.isArray(st.bans) ? st.bans : [];
    const banned = new Set(bans.map((b) => b.worker).concat(bans.map((b) => b.identity).filter((x) => x)));
    const isBanned = (c) => banned.has(c.worker) || (c.identity && banned.has(c.identity));
    const sig = JSON.stringify([list, [...banned]]);
    if (sig === S.creditsSig) return;
    S.creditsSig = sig;
    $('credit-count').textContent = list.length ? list.length + (list.length === 1 ? ' volunteer' : ' volunteers') : '';
    const tbody = $('credits').tBodies[0];
    if (!list.length) {
      tbody.replaceChildren(h('tr', null, h('td', { class: 'empty', colspan: 6 }, 'No work recorded yet.')));
      return;
    }
    tbody.replaceChildren(...list.map((c) => h('tr', { 'data-worker': c.worker, class: isBanned(c) ? 'banned' : null },
      h('td', { class: 'mono' }, h('span', { title: (c.identity ? c.identity + ', last as ' : '') + c.worker }, shortId(c.identity || c.worker))),
      h('td', null, c.name || '—'),
      h('td', { class: 'num' }, fmtCount(c.verified_micro_batches)),
      h('td', { class: 'num' }, fmtGflop(c.verified_gflop)),
      h('td', { class: 'num', title: fmtGflop(c.pending_gflop) + ' GFLOP awaiting an audit' }, fmtCount(c.pending_micro_batches)),
      h('td', { class: 'num', title: isBanned(c) ? 'banned: its work earns nothing in this job' : 'work of a banned worker' },
        fmtCount(c.rejected_micro_batches)))));
  }

  // renderAudit shows the job's verification summary, when the job audits at all.
  function renderAudit(st) {
    const a = st.audit && typeof st.audit === 'object' ? st.audit : null;
    $('audit').hidden = !a;
    $('audit-off').hidden = !!a || !st.job;
    if (!a) return;
    $('audit-rate').textContent = fmtPct(a.rate);
    $('audit-window').textContent = isNum(a.window) ? 'every shard at least once in any ' + a.window + (a.window === 1 ? ' step' : ' steps') + ' of its own in a row' : '—';
    $('audit-count').textContent = fmtCount(a.audits) + ' (' + fmtCount(a.passed) + ' passed, ' + fmtCount(a.failed) + ' failed)';
    $('audit-recompute').textContent = isNum(a.recompute_s) ? fmtMs(1000 * a.recompute_s) : '—';
    $('audit-evidence').textContent = isNum(a.evidence_bytes) && a.audits > 0 ? fmtBytes(a.evidence_bytes / a.audits) : '—';
    $('audit-evidence').title = 'uploaded by the audited volunteer, on average';
    $('audit-share').textContent = fmtPct(a.compute_share);
    $('audit-share').title = 'audited shard-steps as a share of all shard-steps computed';
  }

  function renderBans(st) {
    const list = Array.isArray(st.bans) ? st.bans : [];
    const sig = JSON.stringify(list);
    if (sig === S.bansSig) return;
    S.bansSig = sig;
    const tbody = $('bans').tBodies[0];
    if (!list.length) {
      tbody.replaceChildren(h('tr', null, h('td', { class: 'empty', colspan: 4 }, 'No worker banned.')));
      return;
    }
    // Newest first, as the events are.
    tbody.replaceChildren(...list.slice().reverse().map((b) => {
      const t = parseTime(b.time);
      return h('tr', { 'data-worker': b.worker },
        h('td', { class: 'mono' }, h('span', { title: b.worker }, shortId(b.worker))),
        h('td', { class: 'reason' }, b.reason || '—'),
        h('td', { class: 'num' }, isNum(b.step) ? String(b.step) : '—'),
        h('td', { title: fullTime(t) }, fmtClock(t)));
    }));
  }

  // ---- checkpoints ---------------------------------------------------------------------------

  function renderCheckpoints(list) {
    const tbody = $('checkpoints').tBodies[0];
    if (!list.length) {
      tbody.replaceChildren(h('tr', null, h('td', { class: 'empty', colspan: 7 }, 'No checkpoint yet.')));
      return;
    }
    tbody.replaceChildren(...list.map((ck) => {
      const shards = Array.isArray(ck.shards) ? ck.shards : [];
      const total = shards.reduce((n, s) => n + (isNum(s.bytes) ? s.bytes : 0), 0);
      const created = parseTime(ck.created), completed = parseTime(ck.completed);
      const shardCell = shards.length
        ? h('details', null, h('summary', null, shards.length + ' · ' + fmtBytes(total)),
          h('ul', null, shards.map((s) => h('li', { title: 'sha256 ' + (s.sha256 || '') },
            h('span', { class: 'mono' }, s.name), ' ', fmtBytes(s.bytes), ' ', h('span', { class: 'muted mono' }, String(s.sha256 || '').slice(0, 12))))))
        : '—';
      const complete = ck.state === 'complete';
      const link = complete
        ? h('a', { href: '/api/checkpoints/' + encodeURIComponent(ck.id) + '/model', download: true, title: 'the whole model as one safetensors file' }, 'safetensors')
        : h('span', { class: 'muted' }, '—');
      return h('tr', null,
        h('td', { class: 'mono' }, String(ck.id)),
        h('td', { title: (ck.job || '') + (ck.job_state ? ' (' + ck.job_state + ')' : '') }, ck.job ? shortId(ck.job) : '—'),
        h('td', { class: 'num' }, isNum(ck.step) ? String(ck.step) : '—'),
        h('td', null, ck.state || '—'),
        h('td', { title: 'created ' + fullTime(created) + (completed ? '\ncompleted ' + fullTime(completed) : '') }, fmtClock(completed || created)),
        h('td', null, shardCell),
        h('td', null, link));
    }));
  }

  function renderCheckpointsError(e) {
    $('checkpoints').tBodies[0].replaceChildren(h('tr', null,
      h('td', { class: 'empty', colspan: 7 }, 'Could not list checkpoints: ' + e.message + (e.status === 401 ? ' (sign in again)' : ''))));
  }

  // ---- events --------------------------------------------------------------------------------

  const MAX_EVENTS = 300;

  function eventClass(kind) {
    const k = String(kind || '');
    if (/(^|\.)(joined|complete|resumed|done)$/.test(k)) return 'good';
    if (/(left|error|failed|deadline|abandoned|kick|lost)/.test(k)) return 'bad';
    if (/^(replan|job\.paused|admin|plan)/.test(k)) return 'warn';
    if (/^checkpoint/.test(k)) return 'info';
    return '';
  }

  function detailNodes(detail) {
    if (detail == null) return [];
    if (typeof detail !== 'object') return [String(detail)];
    const out = [];
    for (const [k, v] of Object.entries(detail)) {
      if (out.length) out.push('  ');
      out.push(h('b', null, k), '=' + (typeof v === 'string' ? v : JSON.stringify(v)));
    }
    return out;
  }

  function renderEvents(st) {
    const added = [];
    for (const e of st.events || []) {
      if (!e || e.id == null || S.events.has(e.id)) continue;
      S.events.set(e.id, e);
      added.push(e);
    }
    if (!added.length) {
      if (!S.events.size && !$('events').children.length) $('events').append(h('li', { class: 'muted' }, 'No event yet.'));
      return;
    }
    if (S.eventsPrimed && added.some((e) => /^checkpoint\./.test(e.kind))) loadCheckpoints(); // and the sample
    if (S.eventsPrimed && added.some((e) => /^(job|admin)\./.test(e.kind))) loadJobs();
    S.eventsPrimed = true;
    const all = [...S.events.values()].sort((a, b) => b.id - a.id);
    for (const e of all.slice(MAX_EVENTS)) S.events.delete(e.id);
    $('events').replaceChildren(...all.slice(0, MAX_EVENTS).map((e) => {
      const t = parseTime(e.time);
      return h('li', null,
        h('time', { datetime: e.time, title: fullTime(t) }, fmtClock(t)),
        h('span', { class: 'kind ' + eventClass(e.kind) }, e.kind),
        h('span', { class: 'detail' },
          e.worker ? [h('b', { title: e.worker }, (S.status && peerLabel(S.status, e.worker)) || shortId(e.worker)), '  '] : null,
          detailNodes(e.detail)));
    }));
  }

  // ---- drawing -------------------------------------------------------------------------------

  function scheduleDraw() {
    if (S.drawQueued) return;
    S.drawQueued = true;
    requestAnimationFrame(() => {
      S.drawQueued = false;
      try { drawChart(); } catch (e) { console.error('draw chart', e); }
      try { drawSpark(); } catch (e) { console.error('draw sparkline', e); }
    });
  }

  function palette() {
    const cs = getComputedStyle(document.documentElement);
    const v = (n, d) => cs.getPropertyValue(n).trim() || d;
    return {
      train: v('--train', '#2563eb'), val: v('--val', '#ea580c'), grid: v('--grid', '#e8edf2'),
      axis: v('--axis', '#94a3b8'), muted: v('--muted', '#64748b'), text: v('--text', '#1f2933'), card: v('--card', '#fff'),
    };
  }

  // setupCanvas sizes the backing store to the CSS box × devicePixelRatio and returns a context
  // in CSS pixels.
  function setupCanvas(c) {
    const dpr = window.devicePixelRatio || 1;
    const w = Math.max(1, c.clientWidth), hh = Math.max(1, c.clientHeight);
    const W = Math.round(w * dpr), H = Math.round(hh * dpr);
    if (c.width !== W || c.height !== H) { c.width = W; c.height = H; }
    const ctx = c.getContext('2d');
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, w, hh);
    return { ctx, w, h: hh };
  }

  function niceStep(range, count) {
    const raw = range / Math.max(1, count);
    const mag = Math.pow(10, Math.floor(Math.log10(raw)));
    const n = raw / mag;
    return (n < 1.5 ? 1 : n < 3 ? 2 : n < 7 ? 5 : 10) * mag;
  }

  function linearTicks(lo, hi, count, minStep) {
    if (!(hi > lo)) return { ticks: [lo], step: 1 };
    const st = Math.max(minStep || 0, niceStep(hi - lo, count));
    const out = [];
    for (let v = Math.ceil(lo / st) * st; v <= hi + st * 1e-9; v += st) out.push(+v.toPrecision(12));
    return { ticks: out, step: st };
  }

  // logTicks puts ticks at 1, 2, 5 × 10^k (or only 10^k when crowded) between s0 and s1.
  function logTicks(s0, s1, width) {
    const out = [];
    if (s0 <= 0) out.push(0);
    const k0 = Math.floor(Math.log10(Math.max(1, s0))), k1 = Math.ceil(Math.log10(Math.max(1, s1)));
    const mults = (k1 - k0 + 1) * 3 > width / 45 ? [1] : [1, 2, 5];
    for (let k = k0; k <= k1; k++) {
      for (const m of mults) {
        const v = m * Math.pow(10, k);
        if (v >= s0 && v <= s1) out.push(v);
      }
    }
    return out;
  }

  function drawChart() {
    const c = $('loss-chart');
    const { ctx, w, h: hh } = setupCanvas(c);
    const col = palette();
    const train = [], val = [];
    for (const p of S.curve) {
      if (isNum(p.loss)) train.push(p);
      if (isNum(p.val)) val.push(p);
    }
    c.setAttribute('data-points', String(train.length + val.length));
    c.setAttribute('data-train-points', String(train.length));
    c.setAttribute('data-val-points', String(val.length));
    ctx.font = '12px system-ui, sans-serif';
    if (!train.length && !val.length) {
      ctx.fillStyle = col.muted;
      ctx.textAlign = 'center';
      ctx.textBaseline = 'middle';
      ctx.fillText(S.curveLoaded ? 'waiting for the first step…' : 'loading…', w / 2, hh / 2);
      return;
    }

    let s0 = Infinity, s1 = -Infinity, y0 = Infinity, y1 = -Infinity;
    for (const p of train) { s0 = Math.min(s0, p.step); s1 = Math.max(s1, p.step); y0 = Math.min(y0, p.loss); y1 = Math.max(y1, p.loss); }
    for (const p of val) { s0 = Math.min(s0, p.step); s1 = Math.max(s1, p.step); y0 = Math.min(y0, p.val); y1 = Math.max(y1, p.val); }
    if (s1 <= s0) s1 = s0 + 1;
    if (y1 <= y0) { y0 -= 0.5; y1 += 0.5; } else { const pad = (y1 - y0) * 0.06; y0 -= pad; y1 += pad; }

    const m = { l: 54, r: 14, t: 10, b: 32 };
    const pw = w - m.l - m.r, ph = hh - m.t - m.b;
    if (pw < 20 || ph < 20) return;
    const log = S.logSteps;
    const fx = log ? (s) => Math.log10(Math.max(0, s) + 1) : (s) => s; // log(step+1): step 0 has a place
    const X0 = fx(s0), X1 = fx(s1);
    const px = (s) => m.l + (fx(s) - X0) / (X1 - X0) * pw;
    const py = (v) => m.t + (1 - (v - y0) / (y1 - y0)) * ph;
    S.chartGeom = { m, pw, X0, X1, log };

    // grid and y ticks
    ctx.lineWidth = 1;
    ctx.fillStyle = col.muted;
    ctx.font = '11px system-ui, sans-serif';
    const yt = linearTicks(y0, y1, Math.max(2, Math.floor(ph / 42)));
    const yDigits = Math.max(0, Math.min(6, -Math.floor(Math.log10(yt.step))));
    ctx.textAlign = 'right';
    ctx.textBaseline = 'middle';
    for (const v of yt.ticks) {
      const y = Math.round(py(v)) + 0.5;
      ctx.strokeStyle = col.grid;
      ctx.beginPath(); ctx.moveTo(m.l, y); ctx.lineTo(m.l + pw, y); ctx.stroke();
      ctx.fillText(v.toFixed(yDigits), m.l - 6, y);
    }
    // x ticks
    let xt = log ? logTicks(s0, s1, pw) : [];
    if (xt.length < 2) xt = linearTicks(s0, s1, Math.max(2, Math.floor(pw / 90)), 1).ticks;
    ctx.textAlign = 'center';
    ctx.textBaseline = 'top';
    for (const s of xt) {
      const x = Math.round(px(s)) + 0.5;
      ctx.strokeStyle = col.grid;
      ctx.beginPath(); ctx.moveTo(x, m.t); ctx.lineTo(x, m.t + ph); ctx.stroke();
      ctx.strokeStyle = col.axis;
      ctx.beginPath(); ctx.moveTo(x, m.t + ph); ctx.lineTo(x, m.t + ph + 4); ctx.stroke();
      ctx.fillText(fmtSteps(s), x, m.t + ph + 6);
    }
    // axes
    ctx.strokeStyle = col.axis;
    ctx.beginPath();
    ctx.moveTo(m.l + 0.5, m.t); ctx.lineTo(m.l + 0.5, m.t + ph + 0.5); ctx.lineTo(m.l + pw, m.t + ph + 0.5);
    ctx.stroke();
    ctx.textAlign = 'right';
    ctx.textBaseline = 'bottom';
    ctx.fillText(log ? 'step (log)' : 'step', m.l + pw, hh - 1);

    // series, clipped to the plot
    ctx.save();
    ctx.beginPath(); ctx.rect(m.l, m.t - 4, pw + 4, ph + 8); ctx.clip();
    if (train.length) {
      ctx.strokeStyle = col.train;
      ctx.lineWidth = 1.5;
      ctx.lineJoin = 'round';
      ctx.beginPath();
      train.forEach((p, i) => (i ? ctx.lineTo(px(p.step), py(p.loss)) : ctx.moveTo(px(p.step), py(p.loss))));
      ctx.stroke();
      if (train.length === 1) {
        ctx.fillStyle = col.train;
        ctx.beginPath(); ctx.arc(px(train[0].step), py(train[0].loss), 2.5, 0, 2 * Math.PI); ctx.fill();
      }
    }
    if (val.length) {
      ctx.strokeStyle = col.val;
      ctx.lineWidth = 1;
      ctx.setLineDash([3, 3]);
      ctx.beginPath();
      val.forEach((p, i) => (i ? ctx.lineTo(px(p.step), py(p.val)) : ctx.moveTo(px(p.step), py(p.val))));
      ctx.stroke();
      ctx.setLineDash([]);
      ctx.fillStyle = col.val;
      ctx.strokeStyle = col.card;
      for (const p of val) {
        ctx.beginPath(); ctx.arc(px(p.step), py(p.val), 3.2, 0, 2 * Math.PI); ctx.fill(); ctx.stroke();
      }
    }
    ctx.restore();

    // the step under the pointer
    const hp = S.hover != null ? S.curve[S.hover] : null;
    if (hp) {
      const x = Math.round(px(hp.step)) + 0.5;
      ctx.strokeStyle = col.axis;
      ctx.setLineDash([2, 3]);
      ctx.beginPath(); ctx.moveTo(x, m.t); ctx.lineTo(x, m.t + ph); ctx.stroke();
      ctx.setLineDash([]);
      if (isNum(hp.loss)) { ctx.fillStyle = col.train; ctx.beginPath(); ctx.arc(x, py(hp.loss), 3.5, 0, 2 * Math.PI); ctx.fill(); }
    }
  }

  function drawSpark() {
    const c = $('tps-spark');
    const { ctx, w, h: hh } = setupCanvas(c);
    const vals = S.spark || [];
    if (vals.length < 2) return;
    const col = palette();
    let lo = Math.min(...vals), hi = Math.max(...vals);
    if (hi <= lo) { hi = lo + 1; lo = Math.max(0, lo - 1); }
    const x = (i) => 2 + i / (vals.length - 1) * (w - 4);
    const y = (v) => 3 + (1 - (v - lo) / (hi - lo)) * (hh - 6);
    ctx.beginPath();
    vals.forEach((v, i) => (i ? ctx.lineTo(x(i), y(v)) : ctx.moveTo(x(i), y(v))));
    ctx.strokeStyle = col.train;
    ctx.lineWidth = 1.5;
    ctx.stroke();
    ctx.lineTo(x(vals.length - 1), hh); ctx.lineTo(x(0), hh); ctx.closePath();
    ctx.globalAlpha = 0.12;
    ctx.fillStyle = col.train;
    ctx.fill();
    ctx.globalAlpha = 1;
    ctx.beginPath(); ctx.arc(x(vals.length - 1), y(vals[vals.length - 1]), 2.5, 0, 2 * Math.PI); ctx.fill();
  }

  // onChartMove finds the recorded step nearest the pointer and shows its numbers.
  function onChartMove(ev) {
    const g = S.chartGeom;
    if (!g || !S.curve.length) return;
    const r = ev.currentTarget.getBoundingClientRect();
    const fxv = g.X0 + (ev.clientX - r.left - g.m.l) / g.pw * (g.X1 - g.X0);
    const step = g.log ? Math.pow(10, fxv) - 1 : fxv;
    let lo = 0, hi = S.curve.length - 1;
    while (lo < hi) { // first point with step ≥ the pointer's
      const mid = (lo + hi) >> 1;
      if (S.curve[mid].step < step) lo = mid + 1; else hi = mid;
    }
    if (lo > 0 && Math.abs(S.curve[lo - 1].step - step) < Math.abs(S.curve[lo].step - step)) lo--;
    if (S.hover === lo) return;
    S.hover = lo;
    const p = S.curve[lo];
    $('chart-readout').textContent = 'step ' + p.step + ' · loss ' + fmtLoss(p.loss) +
      (p.val != null ? ' · val ' + fmtLoss(p.val) : '') + (isNum(p.tps) ? ' · ' + fmtNum(p.tps) + ' tokens/s' : '');
    scheduleDraw();
  }

  function onChartLeave() {
    S.hover = null;
    $('chart-readout').textContent = '\u00a0';
    scheduleDraw();
  }

  // ---- start ---------------------------------------------------------------------------------

  function init() {
    try { S.logSteps = localStorage.getItem('shoal.admin.logSteps') === '1'; } catch (_) { /* storage off */ }
    const logBox = $('log-steps');
    logBox.checked = S.logSteps;
    logBox.addEventListener('change', () => {
      S.logSteps = logBox.checked;
      try { localStorage.setItem('shoal.admin.logSteps', S.logSteps ? '1' : '0'); } catch (_) { /* storage off */ }
      S.hover = null;
      scheduleDraw();
    });
    for (const id of ['btn-pause', 'btn-resume', 'btn-checkpoint']) {
      const b = $(id);
      b.addEventListener('click', () => act(b.getAttribute('data-path'), b.getAttribute('data-label'), b));
    }
    $('peers').addEventListener('click', onPeersClick);
    $('jobs').addEventListener('click', onJobsClick);
    $('job-form').addEventListener('submit', submitJob);
    const chart = $('loss-chart');
    chart.addEventListener('mousemove', onChartMove);
    chart.addEventListener('mouseleave', onChartLeave);
    if ('ResizeObserver' in window) new ResizeObserver(scheduleDraw).observe(chart);
    else window.addEventListener('resize', scheduleDraw);

    getJSON('/api/status').then(onStatus).catch((e) => {
      if (e.status === 401) toast('Signed out', 'err', true);
      else console.error('load status', e);
    });
    loadCurve(0);
    loadCheckpoints(); // and the sample, once there is a complete checkpoint
    loadJobs();
    startStream();
    setInterval(refreshAges, 1000);
    scheduleDraw();
  }

  init();
})();
