package histories

import (
	"io"
	"net"
	"sync"
	"time"
)

// proxyMode is what a proxy does with connections.
type proxyMode int

const (
	// forward: every byte to the upstream and back.
	forward proxyMode = iota
	// refuse: existing connections are closed and new ones closed at once (the
	// sidecar sees resets).
	refuse
	// blackhole: existing connections are closed and new ones accepted but never
	// answered (the sidecar sees timeouts).
	blackhole
)

// proxy is a TCP proxy in front of Redis for one sidecar, so that one sidecar can be
// cut off from Redis while the others are not, and so that a failover can point
// the sidecars at the promoted replica.
type proxy struct {
	ln       net.Listener
	mu       sync.Mutex
	upstream string
	mode     proxyMode
	conns    map[net.Conn]struct{}
	wg       sync.WaitGroup
}

func newProxy(upstream string) (*proxy, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	p := &proxy{ln: ln, upstream: upstream, conns: map[net.Conn]struct{}{}}
	p.wg.Add(1)
	go p.accept()
	return p, nil
}

func (p *proxy) port() int { return p.ln.Addr().(*net.TCPAddr).Port }

func (p *proxy) accept() {
	defer p.wg.Done()
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		p.mu.Lock()
		mode, upstream := p.mode, p.upstream
		switch mode {
		case refuse:
			p.mu.Unlock()
			_ = c.Close()
			continue
		case blackhole:
			p.conns[c] = struct{}{}
			p.mu.Unlock()
			continue
		}
		p.conns[c] = struct{}{}
		p.mu.Unlock()
		go p.pipe(c, upstream)
	}
}

func (p *proxy) pipe(c net.Conn, upstream string) {
	u, err := net.DialTimeout("tcp", upstream, time.Second)
	if err != nil {
		p.drop(c)
		return
	}
	p.mu.Lock()
	if _, ok := p.conns[c]; !ok {
		p.mu.Unlock()
		_ = u.Close()
		return
	}
	p.conns[u] = struct{}{}
	p.mu.Unlock()
	done := make(chan struct{}, 2)
	copyHalf := func(dst, src net.Conn) {
		_, _ = io.Copy(dst, src)
		done <- struct{}{}
	}
	go copyHalf(u, c)
	go copyHalf(c, u)
	<-done
	p.drop(c)
	p.drop(u)
}

func (p *proxy) drop(c net.Conn) {
	p.mu.Lock()
	delete(p.conns, c)
	p.mu.Unlock()
	_ = c.Close()
}

// closeAll closes every connection it holds (the caller holds p.mu).
func (p *proxy) closeAllLocked() {
	for c := range p.conns {
		_ = c.Close()
		delete(p.conns, c)
	}
}

// set changes the mode and the upstream; any change closes what is open, as a
// partition or a failover does.
func (p *proxy) set(mode proxyMode, upstream string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if mode == p.mode && upstream == p.upstream {
		return
	}
	p.mode, p.upstream = mode, upstream
	p.closeAllLocked()
}

func (p *proxy) close() {
	_ = p.ln.Close()
	p.mu.Lock()
	p.closeAllLocked()
	p.mu.Unlock()
	p.wg.Wait()
}
