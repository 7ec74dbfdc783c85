// The page's half of the RTC bridge (the worker's is rtcbridge.js): the browser worker's peer
// connections and data channels, which Chromium offers on the page only. shoalRTCPage(worker)
// returns {handle, close}: handle(message) serves one request from the worker; close() closes
// every connection it made, when the worker is gone. The page does no work per message beyond
// a call and a postMessage: payloads are transferred ArrayBuffers in both directions.
'use strict';

// The renderer starts its WebRTC stack on the page's first RTCPeerConnection: a task of 60–100 ms
// on the page's thread (TestBrowserWorkerThread saw it as the one long task of a computing tab,
// when the worker's first neighbour connected). Started here, as the page loads, it costs the
// contributor nothing. No configuration, no offer: nothing is gathered and nothing is sent.
try {
  new RTCPeerConnection().close();
} catch (e) {
  // No WebRTC in this browser: the worker says so when it needs a connection.
}

window.shoalRTCPage = (worker) => {
  const objects = new Map(); // the worker's id → RTCPeerConnection or RTCDataChannel
  const post = (m, transfer) => worker.postMessage(Object.assign({ rtc: true }, m), transfer || []);
  const pcState = (pc) => ({
    connectionState: pc.connectionState, iceConnectionState: pc.iceConnectionState,
    iceGatheringState: pc.iceGatheringState, signalingState: pc.signalingState,
    localDescription: desc(pc.localDescription), remoteDescription: desc(pc.remoteDescription),
  });
  const desc = (d) => (d ? { type: d.type, sdp: d.sdp } : null);
  // Every field pion reads of an RTCIceCandidate (peerconnection_js.go, valueToICECandidate).
  const candidate = (c) => (c ? {
    candidate: c.candidate, sdpMid: c.sdpMid, sdpMLineIndex: c.sdpMLineIndex, usernameFragment: c.usernameFragment,
    foundation: c.foundation, priority: c.priority, address: c.address, protocol: c.protocol, port: c.port,
    type: c.type, tcpType: c.tcpType, relatedAddress: c.relatedAddress, relatedPort: c.relatedPort,
  } : null);

  function newPC(id, config) {
    const pc = new RTCPeerConnection(config);
    objects.set(id, pc);
    const ev = (name, extra) => () => post(Object.assign({ op: 'pcevent', id, name, state: pcState(pc) }, extra));
    pc.onicecandidate = (e) => ev('icecandidate', { candidate: candidate(e.candidate) })();
    for (const name of ['connectionstatechange', 'iceconnectionstatechange', 'icegatheringstatechange', 'signalingstatechange']) {
      pc['on' + name] = ev(name);
    }
  }

  function newDC(id, pcId, label, init) {
    const pc = objects.get(pcId);
    if (!pc) return;
    const dc = pc.createDataChannel(label, init);
    dc.binaryType = 'arraybuffer';
    objects.set(id, dc);
    const ev = (name, extra) => post(Object.assign({ op: 'dcevent', id, name, readyState: dc.readyState }, extra));
    dc.onopen = () => ev('open');
    dc.onclose = () => { objects.delete(id); ev('close'); };
    dc.onerror = (e) => ev('error', { error: { message: (e.error && e.error.message) || 'data channel error' } });
    dc.onbufferedamountlow = () => ev('bufferedamountlow', { buffered: dc.bufferedAmount });
    dc.onmessage = (e) => {
      const data = e.data;
      post({ op: 'dcevent', id, name: 'message', readyState: dc.readyState, data }, data instanceof ArrayBuffer ? [data] : []);
    };
  }

  async function call(m) {
    const pc = objects.get(m.id);
    try {
      if (!pc) throw new DOMException('the peer connection is closed', 'InvalidStateError');
      const value = await pc[m.method](m.arg);
      post({ op: 'reply', id: m.id, call: m.call, value: desc(value) || undefined, state: pcState(pc) });
    } catch (e) {
      post({ op: 'reply', id: m.id, call: m.call, error: { name: e.name || 'Error', message: e.message || String(e) } });
    }
  }

  const calls = new Set(['createOffer', 'createAnswer', 'setLocalDescription', 'setRemoteDescription', 'addIceCandidate']);

  function handle(m) {
    switch (m.op) {
      case 'pc':
        newPC(m.id, m.config);
        break;
      case 'dc':
        newDC(m.id, m.pc, m.label, m.init);
        break;
      case 'call':
        if (calls.has(m.method)) call(m);
        break;
      case 'send': {
        const dc = objects.get(m.id);
        if (!dc) break;
        try {
          dc.send(m.data);
          post({ op: 'sent', id: m.id, n: m.n, buffered: dc.bufferedAmount });
        } catch (e) {
          post({ op: 'dcevent', id: m.id, name: 'error', readyState: dc.readyState, error: { message: 'send: ' + e.message } });
        }
        break;
      }
      case 'dcclose': {
        const dc = objects.get(m.id);
        if (dc) dc.close();
        break;
      }
      case 'close': {
        const pc = objects.get(m.id);
        objects.delete(m.id);
        if (pc) pc.close();
        break;
      }
    }
  }

  function close() {
    for (const o of objects.values()) o.close();
    objects.clear();
  }

  return { handle, close };
};
