// Shoal contributor page. Before Start it only reads: the public job status, whether the browser
// worker (shoal.wasm) is on offer, and whether WebGPU is there. Start makes a dedicated worker
// (worker.js) that loads wasm_exec.js and shoal.wasm — not before — and asks the worker
// (wasm/worker) to join; the statuses it posts draw the rest. Every server string goes in as text, never as markup.
'use strict';

(() => {
  const $ = (id) => document.getElementById(id);
  const params = new URLSearchParams(location.search);
  const joinToken = params.get('join') || '';
  // ?backend=cpu or ?backend=webgpu forces what the tab computes on; otherwise it measures both
  // on Start and takes the faster.
  const backendWanted = params.get('backend') || '';

  // What the page knows; render() draws it.
  const page = {
    wasmReady: false, // the coordinator has shoal.wasm to hand out
    timers: '', // 'worker' once Go's timers run in the worker's thread (worker.js)
    started: false, // Start pressed and not stopped since
    // wanted: the contributor pressed Start and not Stop; paused says why the tab's policy has
    // stopped it meanwhile ('' when it has not), and it starts again when that clears.
    wanted: false,
    paused: '',
    // The pause conditions the contributor chose (kept in localStorage), and the Battery API's
    // manager where the browser has one.
    pauseOn: { battery: false, hidden: false },
    battery: null,
    stopping: false, // Stop pressed, and the worker not yet gone
    loading: false, // fetching or instantiating the wasm
    worker: null, // the worker's last status (client.Status as JSON)
    coord: null, // the last /api/status
    gpu: null, // {found, text}
    problem: '',
    polled: 0, // when /api/status was last asked for
    pollTimer: null,
    // steps records each step the worker reported with the page's visibility at the time, so
    // that step times in the foreground and the background can be compared (the browser test
    // reads it).
    steps: [],
  };
  window.shoalPage = page;

  const text = (id, s) => { const el = $(id); if (el.textContent !== s) el.textContent = s; };
  const shortId = (id) => (typeof id === 'string' && id.length > 10 ? id.slice(-8) : String(id ?? ''));
  const fmt = (x, digits) => (Number.isFinite(x) ? x.toFixed(digits) : '—');

  const stateWords = {
    idle: 'not started', loading: 'loading the worker…', measuring: 'measuring this tab…',
    connecting: 'connecting…', joined: 'connected', reconnecting: 'reconnecting…', stopped: 'stopped',
    paused: 'paused',
  };

  // myShard says what this tab holds: the worker's last assignment while it belongs to the
  // coordinator's current plan, standby when that plan keeps the tab in reserve (the coordinator
  // tells a standby nothing), or waiting before any plan. In a plan of several pipeline replicas
  // the worker's words say which replica and which micro-batches of every step (client.ShardStatus).
  function myShard() {
    const w = page.worker;
    if (!w || w.state !== 'joined') return '—';
    const plan = page.coord && page.coord.plan;
    const id = w.worker_id;
    if (plan && w.plan_version !== plan.version) {
      if ((plan.standby || []).includes(id)) return 'standby: ready to take over from a peer that leaves';
      const holds = (plan.stages || []).some((s) => s.peer === id) || (plan.expert_hosts || []).some((h) => h.peer === id);
      if (!holds) return 'standby: not in the current plan';
    }
    if (w.shard) return w.shard.text + ' (plan v' + w.plan_version + ')';
    return plan && (plan.standby || []).includes(id) ? 'standby: ready to take over from a peer that leaves' : 'waiting for a plan';
  }

  function render() {
    const w = page.worker;
    let state = 'idle';
    if (page.loading) state = 'loading';
    else if (w && page.started) state = w.state;
    else if (w && !page.started) state = 'stopped';
    if (page.paused && !page.started) state = 'paused';
    const st = $('state');
    st.dataset.state = state;
    text('state', state === 'paused' ? 'paused: ' + page.paused + ' (starts again by itself)' : stateWords[state] || state);
    // Start waits for a Stop to finish: the worker says Bye and tears its links down first, and
    // a Start before that would find it still running and do nothing.
    $('btn-start').disabled = page.started || page.paused !== '' || page.stopping || page.loading || !page.wasmReady;
    $('btn-stop').disabled = !page.started && !page.paused;

    const problem = page.problem || (w && w.error && state !== 'joined' ? w.error : '');
    $('problem').hidden = !problem;
    text('problem', problem);

    const c = page.coord;
    if (c && c.job) {
      text('job', shortId(w && w.job ? w.job : c.job.id) + ' · ' + c.job.state);
      text('progress', 'step ' + c.job.step + ' of ' + c.job.steps);
    } else if (c) {
      text('job', 'no job running');
      text('progress', '—');
    }
    const model = (w && w.model) || (c && c.job && c.job.model);
    if (model) text('model', model);
    // A plan of several pipeline replicas: how many, and how they agree (the shard held says
    // which one this tab is in).
    const plan = c && c.job ? c.plan : null;
    const replicas = plan && Number.isFinite(plan.replicas) ? plan.replicas : 1;
    $('pipeline-row').hidden = !(replicas > 1);
    if (replicas > 1) text('pipeline', replicas + ' pipeline replicas, ' + (plan.sync || 'step') + ' sync');
    if (c) {
      const peers = c.peers || [];
      const tabs = peers.filter((p) => p.kind === 'browser').length;
      text('peers', peers.length + ' connected (' + tabs + ' browser ' + (tabs === 1 ? 'tab' : 'tabs') + ')');
    }

    if (page.gpu) text('gpu', page.gpu.text);
    if (w) {
      text('compute', w.compute || '—');
      text('gflops', w.gflops ? fmt(w.gflops, 2) + ' GFLOP/s (reported to the planner)' : '—');
      text('worker-id', w.worker_id || '—');
      text('identity', w.identity || '—');
      text('mbs', String(w.micro_batches || 0) + (w.steps ? ' in ' + w.steps + (w.steps === 1 ? ' step' : ' steps') : ''));
      const ls = w.last_step;
      if (ls) {
        text('last-step', 'step ' + ls.step + ': ' + fmt(ls.total_ms, 0) + ' ms (compute ' + fmt(ls.compute_ms, 0) +
          ', waiting ' + fmt(ls.wait_ms, 0) + ', sending ' + fmt(ls.transfer_ms, 0) + ')');
        text('tps', fmt(ls.tokens_per_s, 0) + ' tokens/s through this shard');
      }
    }
    text('shard', myShard());
    renderMine();
    $('hidden-note').hidden = !(page.started && document.visibilityState === 'hidden');
  }

  const count = (x) => (Number.isFinite(x) ? x.toLocaleString() : '0');
  const gflop = (x) => (Number.isFinite(x) ? x.toLocaleString(undefined, { maximumFractionDigits: 2 }) : '0') + ' GFLOP';
  const work = (mbs, gf) => count(mbs) + (mbs === 1 ? ' micro-batch' : ' micro-batches') + (gf === undefined ? '' : ' · ' + gflop(gf));

  // renderMine shows this browser's volunteer's line of the job's credits — one line for every
  // tab and restart of this browser, kept under its identity — and its ban if it has one: the
  // status carries them when asked with ?worker= (pollStatus).
  function renderMine() {
    const id = myWorkerId();
    const acct = myIdentity();
    const c = page.coord;
    if (!id || !c || !c.job) {
      text('my-verified', id ? '—' : page.started ? 'nothing yet' : 'nothing yet: press Start to contribute');
      text('my-pending', '—');
      $('my-rejected-row').hidden = true;
      $('my-banned').hidden = true;
      return;
    }
    // A job that audits nothing (no audit rate, or a coordinator without a recomputer) never
    // verifies what it records: say so rather than show work awaiting an audit that never comes.
    const audited = !!c.audit;
    text('my-pending-label', audited ? 'Awaiting audit' : 'Not verified');
    $('credit-note').hidden = !audited;
    $('unaudited-note').hidden = audited;
    const mine = (c.credits || []).find((x) => (acct && x.identity === acct) || x.worker === id);
    text('my-verified', mine ? work(mine.verified_micro_batches, mine.verified_gflop) : work(0, 0));
    text('my-pending', mine ? work(mine.pending_micro_batches, mine.pending_gflop) : work(0, 0));
    const rejected = mine ? mine.rejected_micro_batches : 0;
    $('my-rejected-row').hidden = !(rejected > 0);
    text('my-rejected', work(rejected));
    const total = c.volunteer;
    $('my-total-row').hidden = !total;
    if (total) text('my-total', work(total.verified_micro_batches, total.verified_gflop));
    const ban = (c.bans || []).find((b) => b.worker === id || (acct && b.identity === acct));
    $('my-banned').hidden = !ban;
    text('my-banned', ban ? 'This tab was banned from this job at step ' + ban.step + ': ' + (ban.reason || 'no reason given') +
      '. Its work in this job earns no credit.' : '');
  }

  // myWorkerId is the id the coordinator gave this tab's worker, once it joined; it stays after a
  // Stop, so that the page still shows what the tab did.
  const myWorkerId = () => (page.worker && typeof page.worker.worker_id === 'string' ? page.worker.worker_id : '');
  // myIdentity is the fingerprint of this browser's volunteer key (the worker reports it).
  const myIdentity = () => (page.worker && typeof page.worker.identity === 'string' ? page.worker.identity : '');

  // identitySeed returns this browser's volunteer key — 32 random bytes, base64 — kept in
  // IndexedDB, so that every tab and every Start of this browser is one volunteer whose credit
  // adds up. The read and the first write share one readwrite transaction, which IndexedDB runs
  // alone on its store: two tabs starting at once end up with one key. The key names no one; ''
  // when the browser keeps nothing (a private window may refuse): the worker then makes a key for
  // this run alone.
  async function identitySeed() {
    try {
      const db = await new Promise((resolve, reject) => {
        const r = indexedDB.open('shoal', 1);
        r.onupgradeneeded = () => r.result.createObjectStore('identity');
        r.onsuccess = () => resolve(r.result);
        r.onerror = () => reject(r.error);
      });
      try {
        return await new Promise((resolve, reject) => {
          const tx = db.transaction('identity', 'readwrite');
          const store = tx.objectStore('identity');
          let seed = '';
          const get = store.get('seed');
          get.onsuccess = () => {
            seed = typeof get.result === 'string' ? get.result : '';
            if (!seed) {
              const b = crypto.getRandomValues(new Uint8Array(32));
              seed = btoa(String.fromCharCode(...b));
              store.put(seed, 'seed');
            }
          };
          tx.oncomplete = () => resolve(seed);
          tx.onerror = () => reject(tx.error);
          tx.onabort = () => reject(tx.error);
        });
      } finally {
        db.close();
      }
    } catch (e) {
      return '';
    }
  }

  function onStatus(s) {
    const prev = page.worker;
    page.worker = s;
    if (s.last_step && (!prev || !prev.last_step || prev.last_step.step !== s.last_step.step || prev.steps !== s.steps)) {
      page.steps.push({ step: s.last_step.step, total_ms: s.last_step.total_ms, compute_ms: s.last_step.compute_ms,
        visibility: document.visibilityState });
      if (page.steps.length > 1000) page.steps.shift();
    }
    if (s.state === 'stopped') {
      page.started = false;
      // A worker that stopped by itself (an error, a drain) is not started again; one the
      // policy paused is.
      if (!page.paused) page.wanted = false;
    }
    // A condition that came while the worker was loading is honoured once it runs.
    if (page.started && page.wanted && !page.stopping && pauseReason()) {
      applyPolicy();
      return;
    }
    render();
    if (s.last_step) pollSoon();
  }

  // pollSoon asks for the job's status to go with the tab's latest step: at once, or a second
  // after the last request, whichever is later, so that a fast job costs one request a second
  // and the page still ends on its final step.
  function pollSoon() {
    if (page.pollTimer) return;
    page.pollTimer = setTimeout(() => {
      page.pollTimer = null;
      pollStatus();
    }, Math.max(0, 1000 - (Date.now() - page.polled)));
  }

  async function pollStatus() {
    page.polled = Date.now();
    try {
      // A private job's status is shown only to those who present its join token: the one this
      // tab was opened with, in a header rather than the URL (nothing logs or forwards headers).
      // ?worker= adds this tab's own credit and ban to the lists, wherever it stands.
      const id = myIdentity() || myWorkerId();
      const r = await fetch('/api/status' + (id ? '?worker=' + encodeURIComponent(id) : ''), {
        cache: 'no-store', headers: joinToken ? { 'X-Shoal-Join': joinToken } : {},
      });
      if (r.ok) page.coord = await r.json();
    } catch (e) {
      // The coordinator is unreachable for now; the worker's own state says more.
    }
    render();
  }

  async function detectGPU() {
    if (!navigator.gpu) {
      page.gpu = { found: false, text: 'not available in this browser' };
      return;
    }
    try {
      const a = await navigator.gpu.requestAdapter();
      if (!a) {
        page.gpu = { found: false, text: 'no adapter found' };
        return;
      }
      const i = a.info || {};
      const name = [i.vendor, i.architecture, i.device, i.description].filter((x) => x).join(' ') || 'unnamed adapter';
      page.gpu = { found: true, text: name + (i.isFallbackAdapter ? ' (software fallback)' : '') +
        ' — found; on Start the tab times it against the CPU and computes on the faster' };
    } catch (e) {
      page.gpu = { found: false, text: 'adapter request failed: ' + e.message };
    }
  }

  // checkWasm asks whether the coordinator has the worker to hand out, without downloading it.
  async function checkWasm() {
    try {
      const r = await fetch('/shoal.wasm', { method: 'HEAD', cache: 'no-store' });
      page.wasmReady = r.ok;
      if (!r.ok) {
        page.problem = 'This coordinator has no browser worker to hand out (no shoal.wasm). Its admin can build one with ' +
          '`make build` (bin/shoal.wasm beside bin/shoal), or point `shoal serve --wasm-dir` at a directory holding ' +
          'shoal.wasm and wasm_exec.js.';
      }
    } catch (e) {
      page.problem = 'The coordinator is not answering: ' + e.message;
    }
  }

  // The browser worker runs in a dedicated worker (worker.js): its compute, WebGPU, WebSocket,
  // timers and benchmark are off this thread, which only draws and carries the worker's peer
  // connections (rtcpage.js: Chromium has no RTCPeerConnection in workers). Each Start makes a
  // fresh one and each Stop ends it once the worker has said Bye, so that Start and Stop work any
  // number of times without a reload, whatever state the last one left the wasm in.
  let worker = null; // {w, rtc, stopped, finish} while one runs

  function startWorker(opts) {
    const w = new Worker('/contrib/worker.js');
    const rtc = window.shoalRTCPage(w);
    let resolveStopped;
    const cur = { w, rtc, stopped: new Promise((r) => { resolveStopped = r; }) };
    cur.finish = () => {
      if (worker === cur) worker = null;
      rtc.close();
      w.terminate();
      resolveStopped();
    };
    const fail = (why) => {
      page.problem = why;
      page.loading = false;
      page.started = false;
      cur.finish();
      render();
    };
    w.onmessage = (e) => {
      const m = e.data;
      if (m.rtc) {
        rtc.handle(m);
        return;
      }
      switch (m.type) {
        case 'status':
          page.loading = false;
          onStatus(m.status);
          break;
        case 'stopped':
          cur.finish();
          break;
        case 'exited':
          fail('The worker exited.');
          break;
        case 'failed':
          fail('Could not load the worker: ' + m.message);
          break;
      }
    };
    w.onerror = (e) => fail('The worker failed: ' + (e.message || 'unknown error'));
    worker = cur;
    w.postMessage({ type: 'start', opts });
  }

  async function start() {
    if (worker) worker.finish(); // one that stopped by itself
    page.problem = '';
    page.loading = true;
    page.started = true;
    page.timers = 'worker';
    render();
    const ua = navigator.userAgentData;
    const brand = ua && ua.brands ? (ua.brands.find((b) => !/Not.A.Brand/i.test(b.brand)) || {}).brand : '';
    const memGiB = navigator.deviceMemory || 4;
    const job = page.coord && page.coord.job;
    const identity = await identitySeed();
    if (!page.started) return;
    startWorker({
      identity,
      join: joinToken,
      backend: backendWanted,
      name: 'browser' + (brand ? ' ' + brand : '') + (ua && ua.platform ? ' on ' + ua.platform : ''),
      memoryBytes: Math.min(1024, memGiB * 256) * 1024 * 1024,
      // The benchmark times a stage of the job's own model (wasm/worker, backend.go).
      modelConfig: job && job.model_config ? JSON.stringify(job.model_config) : '',
    });
  }

  // stopGrace bounds how long Stop waits for the worker's Bye: a worker in the middle of a long
  // step hears Stop only when the step ends, and the contributor asked for it to end now.
  const stopGrace = 30000;

  // stop ends the worker: at once with its Bye (the contributor's Stop), or, atBoundary (a
  // pause), at the job's next step boundary, once the coordinator has what the tab holds.
  async function stop(reason, atBoundary) {
    page.started = false;
    page.stopping = true;
    render();
    const cur = worker;
    if (cur) {
      cur.w.postMessage({ type: 'stop', reason, atBoundary: !!atBoundary });
      const late = setTimeout(cur.finish, stopGrace);
      await cur.stopped;
      clearTimeout(late);
    }
    page.stopping = false;
    applyPolicy(); // a condition may have cleared while the worker left
  }

  // pauseReason says why the contributor's choices keep the tab from computing now ('' when
  // nothing does).
  function pauseReason() {
    if (page.pauseOn.battery && page.battery && !page.battery.charging) return 'on battery';
    if (page.pauseOn.hidden && document.visibilityState === 'hidden') return 'the tab is hidden';
    return '';
  }

  // applyPolicy pauses a tab the contributor started when one of their conditions holds — a
  // Stop, so that the worker hands its shard back as it does then — and starts it again when
  // none does. A Stop still under way is waited for (stop calls this again when it is done).
  function applyPolicy() {
    if (!page.wanted || page.stopping || page.loading) {
      render();
      return;
    }
    const why = pauseReason();
    if (why && page.started) {
      page.paused = why;
      stop('paused: ' + why, true);
    } else if (why && !page.paused) {
      page.paused = why; // started while a condition holds: wait for it to clear
      render();
    } else if (!why && page.paused) {
      page.paused = '';
      start();
    } else {
      if (why) page.paused = why;
      render();
    }
  }

  const policyKey = 'shoal.pauseOn';
  function loadPolicy() {
    try {
      const v = JSON.parse(localStorage.getItem(policyKey) || '{}');
      page.pauseOn = { battery: v.battery === true, hidden: v.hidden === true };
    } catch (e) {
      // Nothing kept, or storage refused (a private window): the defaults.
    }
    $('pause-battery').checked = page.pauseOn.battery;
    $('pause-hidden').checked = page.pauseOn.hidden;
  }
  function savePolicy() {
    page.pauseOn = { battery: $('pause-battery').checked, hidden: $('pause-hidden').checked };
    try {
      localStorage.setItem(policyKey, JSON.stringify(page.pauseOn));
    } catch (e) {
      // Kept for this page only.
    }
    applyPolicy();
  }
  // The Battery API is Chromium's alone: elsewhere the choice cannot be honoured, and says so.
  async function watchBattery() {
    if (typeof navigator.getBattery !== 'function') {
      $('pause-battery').disabled = true;
      $('battery-note').hidden = false;
      return;
    }
    try {
      page.battery = await navigator.getBattery();
      page.battery.addEventListener('chargingchange', applyPolicy);
    } catch (e) {
      $('pause-battery').disabled = true;
      $('battery-note').hidden = false;
    }
  }

  $('btn-start').addEventListener('click', () => {
    page.wanted = true;
    page.paused = '';
    if (pauseReason()) applyPolicy();
    else start();
  });
  $('btn-stop').addEventListener('click', () => {
    page.wanted = false;
    const wasPaused = page.paused;
    page.paused = '';
    if (page.stopping && worker) {
      // A pause's leave under way: the contributor wants it over now.
      worker.w.postMessage({ type: 'stop', reason: 'stopped by the contributor' });
      render();
    } else if (wasPaused && !page.started) render();
    else stop('stopped by the contributor');
  });
  $('pause-battery').addEventListener('change', savePolicy);
  $('pause-hidden').addEventListener('change', savePolicy);
  // Closing the tab, or leaving the page, is a departure the coordinator is told of: stop sends
  // the worker's Bye before this handler returns. pagehide fires where beforeunload does not
  // (mobile browsers, the back-forward cache).
  window.addEventListener('pagehide', () => {
    if (worker) worker.w.postMessage({ type: 'stop', reason: 'tab closed' });
  });
  document.addEventListener('visibilitychange', applyPolicy);
  loadPolicy();
  watchBattery().then(applyPolicy);

  text('origin', location.origin);
  $('private').hidden = !joinToken;
  Promise.all([checkWasm(), detectGPU(), pollStatus()]).then(render);
  setInterval(pollStatus, 3000);
})();
