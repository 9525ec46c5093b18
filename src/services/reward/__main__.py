from services.reward.service import main

raise SystemExit(main())
