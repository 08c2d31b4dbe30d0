//! NVMe/TCP PDU headers with every digest setting, and the bodies decoded from them: nothing
//! panics, a decoded header's spans stay inside its PLEN, and a capsule's Connect data and
//! DSM ranges decode or fail with a typed error.
#![no_main]

use libfuzzer_sys::fuzz_target;
use reflex_proto::nvme_tcp::command::{Command, ConnectData, DSM_RANGE_SIZE, DsmRange};
use reflex_proto::nvme_tcp::pdu::{Digests, Pdu, decode_header};

fuzz_target!(|data: &[u8]| {
    let Some((&selector, input)) = data.split_first() else {
        return;
    };
    let digests = Digests::from_byte(selector);
    if let Ok(Some(decoded)) = decode_header(input, digests) {
        assert!(decoded.header_bytes <= input.len());
        if let Some(span) = decoded.data {
            assert!(span.offset >= decoded.header_bytes.min(span.offset));
            assert_eq!(span.end(), decoded.total_bytes);
        }
        if let Pdu::CapsuleCmd(sqe) = decoded.pdu {
            let command = Command(sqe);
            let _ = (
                command.sgl(),
                command.connect(),
                command.slba(),
                command.block_count(),
            );
            let body = &input[decoded.header_bytes.min(input.len())..];
            let _ = ConnectData::decode(body);
            for chunk in body.chunks_exact(DSM_RANGE_SIZE) {
                if let Some(range) = chunk.first_chunk::<DSM_RANGE_SIZE>() {
                    let _ = DsmRange::decode(range);
                }
            }
        }
    }
});
