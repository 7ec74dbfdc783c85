// A dedicated worker that keeps time for the contributor page. Browsers throttle the timers of a
// page in a background tab — to one wake-up a second, and after a minute or so hidden to one a
// minute — but not a dedicated worker's, nor the messages it posts to the page. The page routes
// setTimeout through here (contrib.js, unthrottledTimers), so that the Go runtime's timers
// (heartbeats, backoff, deadlines) keep their time in a background tab.
'use strict';

const timers = new Map();

onmessage = (e) => {
  const { id, ms, clear } = e.data;
  if (clear) {
    clearTimeout(timers.get(id));
    timers.delete(id);
    return;
  }
  timers.set(id, setTimeout(() => {
    timers.delete(id);
    postMessage(id);
  }, ms));
};
