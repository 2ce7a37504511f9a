// The vpool portal's only script: it follows a job page live (server-sent events) and toggles
// rank labels in the output. Pages work without it; they just do not update by themselves.
"use strict";

(function () {
  const job = document.getElementById("job");
  const output = document.getElementById("output");
  const labels = document.getElementById("label-lines");
  if (labels && output) {
    labels.addEventListener("change", () => output.classList.toggle("labels", labels.checked));
  }
  if (!job || !output || job.dataset.live !== "yes" || !window.EventSource) {
    return;
  }

  // Output arrives in chunks cut anywhere: keep, per rank and stream, the bytes of the line not
  // finished yet, and show only whole lines, so that two ranks never share a line.
  const partial = new Map(); // "rank:stream" -> {decoder, text}
  const seed = JSON.parse(job.dataset.seed || "{}");
  for (const [key, b64] of Object.entries(seed)) {
    take(key, b64);
  }

  function take(key, b64) {
    let slot = partial.get(key);
    if (!slot) {
      slot = { decoder: new TextDecoder("utf-8"), text: "" };
      partial.set(key, slot);
    }
    const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
    slot.text += slot.decoder.decode(bytes, { stream: true });
    const cut = slot.text.lastIndexOf("\n") + 1;
    const whole = slot.text.slice(0, cut);
    slot.text = slot.text.slice(cut);
    return whole;
  }

  function append(rank, stream, text) {
    if (!text) {
      return;
    }
    const span = document.createElement("span");
    span.className = stream === "stderr" ? "ln err" : "ln";
    span.dataset.rank = String(rank);
    span.textContent = text;
    output.appendChild(span);
  }

  function flushAll() {
    for (const [key, slot] of partial) {
      const text = slot.text + slot.decoder.decode();
      if (text) {
        const [rank, stream] = key.split(":");
        append(rank, stream, text.endsWith("\n") ? text : text + "\n");
      }
    }
    partial.clear();
  }

  const params = new URLSearchParams({ after: job.dataset.cursor || "0" });
  if (job.dataset.rank) {
    params.set("rank", job.dataset.rank);
  }
  const source = new EventSource(`/jobs/${job.dataset.job}/live?${params}`);
  const status = document.getElementById("output-status");

  source.addEventListener("output", (event) => {
    const atBottom = output.scrollHeight - output.scrollTop - output.clientHeight < 40;
    for (const record of JSON.parse(event.data)) {
      append(record.rank, record.stream, take(`${record.rank}:${record.stream}`, record.data));
    }
    if (atBottom) {
      output.scrollTop = output.scrollHeight;
    }
  });

  source.addEventListener("state", (event) => {
    const nl = event.data.indexOf("\n");
    job.dataset.state = event.data.slice(0, nl);
    document.getElementById("live").innerHTML = event.data.slice(nl + 1);
  });

  source.addEventListener("end", (event) => {
    source.close();
    flushAll();
    job.dataset.state = event.data;
    job.dataset.live = "no";
    if (status) {
      status.textContent = "The job ended; this is all of its output.";
    }
  });

  source.addEventListener("error", () => {
    if (status && source.readyState === EventSource.CLOSED) {
      status.textContent = "Live updates stopped; reload the page to see more.";
    }
  });
})();
