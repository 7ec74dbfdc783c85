// The browser worker's thread: a dedicated worker that runs shoal.wasm — its compute (the CPU
// kernels or WebGPU, which workers have), its WebSocket to the coordinator, its timers, and the
// backend benchmark — so that the page's main thread only draws. Go's timers here are a dedicated
// worker's, which background tabs do not throttle. The page (contrib.js) makes one per Start and
// terminates it once the worker has said Bye, so Stop and Start need no reload and a worker that
// failed leaves nothing behind.
//
// Messages from the page: {type: 'start', opts} (wasm/worker's shoal.start options, without
// onStatus), {type: 'stop', reason, atBoundary}, and the RTC bridge's replies (rtcbridge.js). To the page:
// {type: 'status', status}, {type: 'stopped'}, {type: 'exited'}, {type: 'failed', message}, and
// the RTC bridge's requests.
'use strict';

// pion/webrtc's js build finds RTCPeerConnection on window, which a worker does not have.
self.window = self;
importScripts('/wasm_exec.js', '/contrib/rtcbridge.js');

let stopping = null;

async function start(opts) {
  const go = new Go();
  const res = await WebAssembly.instantiateStreaming(fetch('/shoal.wasm'), go.importObject);
  go.run(res.instance).then(() => postMessage({ type: 'exited' }));
  if (!self.shoal) throw new Error('shoal.wasm did not define the worker API');
  opts.onStatus = (status) => postMessage({ type: 'status', status });
  self.shoal.start(opts);
}

onmessage = (e) => {
  const m = e.data;
  if (m.rtc) {
    shoalRTC.fromPage(m);
    return;
  }
  if (m.type === 'start') {
    start(m.opts).catch((err) => postMessage({ type: 'failed', message: err.message }));
  } else if (m.type === 'stop') {
    // A stop at the step boundary (a pause) may be followed by one now (the tab closing): each
    // reaches the worker; the page hears 'stopped' once.
    const left = self.shoal && self.shoal.running() ? self.shoal.stop(m.reason, !!m.atBoundary) : Promise.resolve();
    if (!stopping) stopping = left.finally(() => postMessage({ type: 'stopped' }));
  }
};
