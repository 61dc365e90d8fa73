/* A Worker for pages opened from disk (file://), where the browser refuses `new Worker(url)`: the search's worker
   script runs in a hidden iframe of the page, and messages pass between the two windows. Material's offline plugin
   loads a shim of this kind, by default from unpkg.com; this site reaches nothing outside itself, so it carries its
   own (mkdocs.yml, extra.polyfills; the plugin adds none when a polyfill's name holds "iframe-worker"). Served over
   http(s), the page keeps the browser's Worker. */
(function () {
  "use strict";
  if (location.protocol !== "file:") {
    return;
  }

  class IFrameWorker extends EventTarget {
    constructor(url) {
      super();
      this.onmessage = null;
      this.onerror = null;
      this.pending = [];  // messages posted before the worker's script has run
      this.iframe = document.createElement("iframe");
      this.iframe.style.display = "none";
      document.body.appendChild(this.iframe);
      const scope = this.iframe.contentWindow;  // about:blank: the page's own origin
      scope.postMessage = (data) => {  // the worker's postMessage: to this object's listeners
        setTimeout(() => this.deliver(new MessageEvent("message", { data })));
      };
      const script = scope.document.createElement("script");
      script.onload = () => {
        this.scope = scope;
        this.pending.splice(0).forEach((data) => this.postMessage(data));
      };
      script.onerror = () => this.deliver(new ErrorEvent("error", { message: `cannot load ${url}` }));
      script.src = new URL(url, location.href).href;
      scope.document.head.appendChild(script);
    }

    deliver(event) {
      const handler = event.type === "message" ? this.onmessage : this.onerror;
      if (typeof handler === "function") {
        handler.call(this, event);
      }
      this.dispatchEvent(event);
    }

    postMessage(data) {
      if (!this.scope) {
        this.pending.push(data);
        return;
      }
      setTimeout(() => this.scope.dispatchEvent(new this.scope.MessageEvent("message", { data })));
    }

    terminate() {
      this.iframe.remove();
    }
  }

  window.Worker = IFrameWorker;
})();
