//! The routers' network namespaces: each router runs in its own, joined to this one
//! by a veth pair, so that a partition is its link going down while everything else
//! keeps running. Created at the start of a run, removed at its end (also on error).

use crate::process::run;

/// The namespaces of one run (`soak<pid>r<i>`, veth `sk<pid>r<i>h`/`n`,
/// `10.231.<i>.0/30`: .1 this side, .2 the router's).
#[derive(Debug)]
pub(crate) struct Namespaces {
    names: Vec<String>,
    tag: u32,
}

impl Namespaces {
    pub(crate) fn create(routers: usize) -> Result<Namespaces, String> {
        let tag = std::process::id() % 100_000;
        let mut ns = Namespaces {
            names: Vec::new(),
            tag,
        };
        for i in 0..routers {
            let name = format!("soak{tag}r{i}");
            run("ip", &["netns", "add", &name])?;
            ns.names.push(name.clone());
            let (host, inner) = ns.veth(i);
            run(
                "ip",
                &["link", "add", &host, "type", "veth", "peer", "name", &inner],
            )?;
            run("ip", &["link", "set", &inner, "netns", &name])?;
            run(
                "ip",
                &["addr", "add", &format!("10.231.{i}.1/30"), "dev", &host],
            )?;
            run("ip", &["link", "set", &host, "up"])?;
            let exec = |args: &[&str]| {
                let mut all = vec!["netns", "exec", name.as_str()];
                all.extend_from_slice(args);
                run("ip", &all)
            };
            exec(&[
                "ip",
                "addr",
                "add",
                &format!("10.231.{i}.2/30"),
                "dev",
                &inner,
            ])?;
            exec(&["ip", "link", "set", &inner, "up"])?;
            exec(&["ip", "link", "set", "lo", "up"])?;
            exec(&[
                "ip",
                "route",
                "add",
                "default",
                "via",
                &format!("10.231.{i}.1"),
            ])?;
        }
        Ok(ns)
    }

    fn veth(&self, i: usize) -> (String, String) {
        (
            format!("sk{}r{i}h", self.tag),
            format!("sk{}r{i}n", self.tag),
        )
    }

    /// The namespace of router `i`.
    pub(crate) fn name(&self, i: usize) -> &str {
        self.names.get(i).map_or("", String::as_str)
    }

    /// The address etcd and the relays are reached at from every namespace (this
    /// side of router 0's veth: routed to from the others, local here).
    pub(crate) fn host_address(&self) -> &'static str {
        "10.231.0.1"
    }

    /// Takes router `i`'s link down (`false`) or up, inside its namespace.
    pub(crate) fn link(&self, i: usize, up: bool) -> Result<(), String> {
        let (_, inner) = self.veth(i);
        run(
            "ip",
            &[
                "netns",
                "exec",
                self.name(i),
                "ip",
                "link",
                "set",
                &inner,
                if up { "up" } else { "down" },
            ],
        )?;
        if up {
            // A link that went down lost its default route: without it the router
            // never reaches etcd or the relays again, so a failure is the fault's
            // (a few tries: the link's own route may take a moment to come back).
            let gateway = format!("10.231.{i}.1");
            let args = [
                "netns",
                "exec",
                self.name(i),
                "ip",
                "route",
                "replace",
                "default",
                "via",
                gateway.as_str(),
            ];
            let mut tries = 0;
            loop {
                match run("ip", &args) {
                    Ok(()) => break,
                    Err(e) if tries >= 4 => return Err(format!("restoring the route: {e}")),
                    Err(_) => {
                        tries += 1;
                        std::thread::sleep(std::time::Duration::from_millis(50));
                    }
                }
            }
        }
        Ok(())
    }
}

impl Drop for Namespaces {
    fn drop(&mut self) {
        for (i, name) in self.names.iter().enumerate() {
            let _ = run("ip", &["link", "del", &format!("sk{}r{i}h", self.tag)]);
            let _ = run("ip", &["netns", "del", name]);
        }
    }
}
