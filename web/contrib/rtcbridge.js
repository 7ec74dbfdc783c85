// The worker's half of the RTC bridge. Chromium has no RTCPeerConnection in workers, so the
// browser worker's peer connections and data channels live on the page (rtcpage.js), and this
// file gives pion/webrtc's js build, in the worker, objects with the part of their API it uses:
// calls become messages to the page, the page's events come back as messages. Message payloads
// cross as transferred ArrayBuffers, never copied on the page's thread. Where a browser offers
// RTCPeerConnection in workers, the worker uses it directly and this bridge stays idle.
//
// bufferedAmount, which the page's channel knows, is answered here at once, as the real one is:
// the bytes handed to the page and not yet acknowledged, plus the page channel's own amount as
// of its last acknowledgement or bufferedamountlow. It can only overstate the real amount, so the
// worker's flow control (client/rtc_peer.go) never sends more than its bound.
'use strict';

self.shoalRTC = (() => {
  const objects = new Map(); // id → BridgePC or BridgeDC
  const calls = new Map(); // call id → {resolve, reject}
  let next = 1;
  const post = (m, transfer) => postMessage(Object.assign({ rtc: true }, m), transfer || []);

  class BridgePC {
    constructor(config) {
      this._bid = next++;
      objects.set(this._bid, this);
      Object.assign(this, { connectionState: 'new', iceConnectionState: 'new', iceGatheringState: 'new',
        signalingState: 'stable', localDescription: null, remoteDescription: null });
      post({ op: 'pc', id: this._bid, config });
    }
    call(method, arg) {
      return new Promise((resolve, reject) => {
        const c = next++;
        calls.set(c, { resolve, reject });
        post({ op: 'call', id: this._bid, call: c, method, arg });
      });
    }
    createOffer() { return this.call('createOffer'); }
    createAnswer() { return this.call('createAnswer'); }
    setLocalDescription(d) { return this.call('setLocalDescription', d && { type: d.type, sdp: d.sdp }); }
    setRemoteDescription(d) { return this.call('setRemoteDescription', d && { type: d.type, sdp: d.sdp }); }
    addIceCandidate(c) { return this.call('addIceCandidate', c); }
    createDataChannel(label, init) { return new BridgeDC(this, label, init || {}); }
    close() {
      if (this.connectionState === 'closed') return;
      this.connectionState = this.iceConnectionState = 'closed';
      this.signalingState = 'closed';
      objects.delete(this._bid);
      post({ op: 'close', id: this._bid });
    }
  }

  class BridgeDC {
    constructor(pc, label, init) {
      this._bid = next++;
      objects.set(this._bid, this);
      Object.assign(this, { label, readyState: 'connecting', binaryType: 'arraybuffer', ordered: init.ordered !== false,
        negotiated: !!init.negotiated, protocol: init.protocol || '', maxRetransmits: init.maxRetransmits ?? null,
        maxPacketLifeTime: init.maxPacketLifeTime ?? null });
      this.id = init.id ?? null; // the SCTP stream id, as RTCDataChannel.id
      this.threshold = 0;
      this.unacked = 0; // bytes posted to the page and not yet handed to its channel
      this.pageBuffered = 0; // the page channel's bufferedAmount when last heard
      this.above = false; // bufferedAmount was above the threshold since the last low event
      post({ op: 'dc', id: this._bid, pc: pc._bid, label, init });
    }
    get bufferedAmount() { return this.unacked + this.pageBuffered; }
    get bufferedAmountLowThreshold() { return this.threshold; }
    set bufferedAmountLowThreshold(n) { this.threshold = Number(n) || 0; }
    send(data) {
      if (this.readyState !== 'open') throw new DOMException('the data channel is not open', 'InvalidStateError');
      let n;
      if (typeof data === 'string') {
        n = new TextEncoder().encode(data).byteLength;
        post({ op: 'send', id: this._bid, data, n });
      } else {
        // pion copies each message into a fresh Uint8Array of its own: its buffer can be given away.
        const whole = data.byteOffset === 0 && data.byteLength === data.buffer.byteLength;
        const buf = whole ? data.buffer : data.buffer.slice(data.byteOffset, data.byteOffset + data.byteLength);
        n = buf.byteLength;
        post({ op: 'send', id: this._bid, data: buf, n }, [buf]);
      }
      this.unacked += n;
      if (this.bufferedAmount > this.threshold) this.above = true;
    }
    close() {
      if (this.readyState === 'closed' || this.readyState === 'closing') return;
      this.readyState = 'closing';
      post({ op: 'dcclose', id: this._bid });
    }
    buffered(acked, pageBuffered) {
      this.unacked -= acked;
      this.pageBuffered = pageBuffered;
      if (this.above && this.bufferedAmount <= this.threshold) {
        this.above = false;
        if (this.onbufferedamountlow) this.onbufferedamountlow({});
      }
    }
  }

  function fromPage(m) {
    if (m.op === 'reply') {
      const c = calls.get(m.call);
      if (!c) return;
      calls.delete(m.call);
      const pc = objects.get(m.id);
      if (pc && m.state) Object.assign(pc, m.state);
      if (m.error) c.reject(new DOMException(m.error.message, m.error.name));
      else c.resolve(m.value);
      return;
    }
    const o = objects.get(m.id);
    if (!o) return;
    switch (m.op) {
      case 'pcevent': // icecandidate, connectionstatechange, …: the page's state comes with it
        Object.assign(o, m.state);
        if (m.name === 'connectionstatechange' && o.connectionState === 'closed') objects.delete(o._bid);
        if (o['on' + m.name]) o['on' + m.name]({ candidate: m.candidate });
        break;
      case 'dcevent':
        o.readyState = m.readyState;
        if (m.name === 'close') objects.delete(o._bid);
        if (m.name === 'bufferedamountlow') {
          o.buffered(0, m.buffered);
          break;
        }
        if (o['on' + m.name]) o['on' + m.name]({ data: m.data, error: m.error });
        break;
      case 'sent':
        o.buffered(m.n, m.buffered);
        break;
    }
  }

  if (typeof self.RTCPeerConnection !== 'function') self.RTCPeerConnection = BridgePC;
  return { fromPage };
})();
