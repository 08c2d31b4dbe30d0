//! `reflex kv` as an operator runs it, against a real reflexd's KV port.

mod common;

use reflex_server::config::KvConfig;
use reflex_server::{Config, NamespaceConfig};

use common::reflex;

#[test]
fn put_get_delete_flush_from_the_shell() {
    let server = common::start_server(Config {
        kv: KvConfig {
            enabled: true,
            port: 0,
            ..KvConfig::default()
        },
        ..Config::loopback(vec![NamespaceConfig::new(1, "mem:32M")])
    });
    let address = server
        .kv_addr()
        .unwrap_or_else(|| panic!("no KV listener"))
        .to_string();
    let run = |args: &[&str]| {
        let mut all = vec!["kv", "-s", &address];
        all.extend_from_slice(args);
        reflex(&all)
    };
    assert!(run(&["put", "colour", "blue"]).status.success());
    let got = run(&["get", "colour"]);
    assert!(got.status.success());
    assert_eq!(got.stdout, b"blue");
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let file = dir.path().join("value.bin");
    std::fs::write(&file, [0u8, 1, 2, 255]).unwrap_or_else(|e| panic!("{e}"));
    let file = file.display().to_string();
    assert!(
        run(&["put", "binary", "--value-file", &file])
            .status
            .success()
    );
    assert_eq!(run(&["get", "binary"]).stdout, [0u8, 1, 2, 255]);
    assert!(run(&["delete", "colour"]).status.success());
    assert_eq!(run(&["get", "colour"]).status.code(), Some(2));
    assert_eq!(run(&["delete", "colour"]).status.code(), Some(2));
    assert!(run(&["flush"]).status.success());
    server.shutdown().unwrap_or_else(|e| panic!("{e}"));
}
